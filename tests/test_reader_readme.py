"""docs/reading.md's examples (reading, token masks, training on a stream) and
docs/training.md's PyTorch dataset run as written on a real run."""

from __future__ import annotations

import pathlib
import re

import numpy as np

from actx import reader
from tests import reader_fixtures as rf

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
READING, TRAINING = DOCS / "reading.md", DOCS / "training.md"


def test_training_loop_example_runs(tmp_path):
    text = READING.read_text()
    section = text[text.index("## Training on a stream"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len([line for line in code.splitlines() if line.strip()]) <= 12
    truth = rf.build_run(str(tmp_path / "run"), num_partitions=4, partition_rows=16,
                         rows_per_shard=8, committed=(0, 1, 2, 3), dtype="bfloat16")
    scope = {"run_dir": truth.uri}
    exec(compile(code, "docs/reading.md (training on a stream)", "exec"), scope)
    batches, last = scope["batches"], scope["b"]
    # Both epochs ran to the end, and the probe's weights are those of the same SGD steps
    # replayed here in float64 on the fixture's values, standardised with numpy's
    # statistics (the stream's order is its own, tested in test_reader_stream).
    assert last.step == 2 * batches.steps_per_epoch - 1 and last.epoch == 1
    hook = "layers.0.resid_post"
    assert "batch_size=256, buffer_tokens=1 << 14, seed=0, epochs=2" in code
    rows, cols = np.nonzero(truth.committed_mask())
    all_x = truth.value(hook, rows, cols).astype(np.float64)
    mean, std = all_x.mean(axis=0), all_x.std(axis=0)
    want = np.zeros(truth.hidden)
    run = reader.open_run(truth.uri)
    for b in run.stream(hook, batch_size=256, buffer_tokens=1 << 14, seed=0, epochs=2):
        x = (truth.value(hook, b.rows, b.cols).astype(np.float64) - mean) / std
        y = (truth.tokens["input_ids"][b.rows, b.cols] % 2).astype(np.float64)
        want -= 0.05 * x.T @ (x @ want - y) / len(y)
    assert np.abs(want).sum() > 0
    np.testing.assert_allclose(scope["w"], want, rtol=1e-4, atol=1e-7)


def _block(text: str, heading: str, nth: int = 0) -> str:
    section = text[text.index(heading):]
    return re.findall(r"```python\n(.*?)```", section, re.S)[nth]


def _arc_run(tmp_path, monkeypatch) -> rf.RunTruth:
    # Real ARC task ids, as the page's block names one.
    monkeypatch.setattr(rf, "ARC_TASKS", ("007bbfb7", "00d62c1b"))
    return rf.build_run(str(tmp_path / "run"), num_partitions=4, partition_rows=16,
                        rows_per_shard=8, committed=(0, 1, 2, 3), dtype="float32")


def test_reading_and_token_mask_examples_run(tmp_path, monkeypatch, capsys):
    text = READING.read_text()
    truth = _arc_run(tmp_path, monkeypatch)
    scope = {"run_dir": truth.uri}
    exec(compile(_block(text, "# Reading activations"), "docs/reading.md (reading)", "exec"),
         scope)
    hook = scope["hook"]
    assert f"'committed': [0, 1, 2, 3]" in capsys.readouterr().out
    # The stream's last batch: device arrays whose norms are those of the tokens it names.
    b, norms = scope["b"], scope["norms"]
    want = np.linalg.norm(truth.value(hook, b.rows, b.cols).astype(np.float64), axis=-1)
    np.testing.assert_allclose(np.asarray(norms), want, rtol=1e-6)
    assert not np.isin(truth.tokens["input_ids"][b.rows, b.cols], [rf.BOS_ID]).any()
    # The selection: every cell of the first task's test input, against the token arrays.
    t = truth.tokens
    r, c = np.nonzero((t["arc_task"] == 0) & (t["arc_grid"] == 2) & (t["arc_row"] >= 0))
    assert len(r) > 0
    np.testing.assert_array_equal(scope["sel"].rows, r)
    np.testing.assert_array_equal(scope["sel"].acts[hook], truth.value(hook, r, c))
    rows, cols = np.nonzero(truth.committed_mask())
    stats = scope["stats"][hook]
    assert stats.count == len(rows)
    np.testing.assert_allclose(stats.mean, truth.value(hook, rows, cols).astype(
        np.float64).mean(axis=0), rtol=1e-9)
    assert sum(len(x.rows) for x in scope["exact"]) // 256 * 256 == len(rows) // 256 * 256

    exec(compile(_block(text, "## Token masks"), "docs/reading.md (token masks)", "exec"),
         scope)
    removed = reader.open_run(truth.uri).describe()["masks"]["removed"]
    first_tokens = sum(1 for d in truth.docs)  # every document's first token is BOS here
    assert removed["bos"] >= first_tokens > 0


def test_torch_dataset_example_runs(tmp_path, monkeypatch):
    """The block as a script: its loader's spawned workers import it again, so it starts
    the loader under `if __name__ == "__main__":` (here its `read` is called instead)."""
    text = TRAINING.read_text()
    truth = _arc_run(tmp_path, monkeypatch)
    code = _block(text, "## PyTorch: your own loop")
    assert re.search(r'^if __name__ == "__main__":', code, re.M)
    assert "loader(num_workers=2" in code
    # normalize= needs them, over the tokens served, as the page says
    reader.open_run(truth.uri).compute_stats(exclude=["bos", "special"])
    scope = {"__name__": "docs_training"}       # imported, not run as a script
    exec(compile(code, "docs/training.md (PyTorch dataset)", "exec"), scope)
    import torch

    step, x = scope["read"](truth.uri)
    kept = truth.committed_mask() & ~np.isin(truth.tokens["input_ids"], rf.SPECIAL_IDS)
    # Each of the 2 workers reads its own share and drops its own last partial batch.
    whole = int(kept.sum()) // 256
    assert whole - 1 <= step + 1 <= whole
    assert x.shape == (256, truth.hidden) and x.dtype == torch.float32
    assert torch.isfinite(x).all()


def test_train_while_it_extracts_recipe_runs(tmp_path):
    """docs/training.md's recipe as written: the bash block's 2-host local extraction runs
    in a process of its own while the python block trains an SAE following it; the
    trainer's tokens are counted against the run's."""
    import os
    import shlex
    import subprocess
    import sys

    from tests import hf_models, token_runs

    text = TRAINING.read_text()
    section = text[text.index("## Train while it extracts"):]
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1).split("#")[0].strip()
    code = _block(text, "## Train while it extracts")
    assert command == "actx rerun runs/mine --hosts 2"
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=1)
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, str(model), n_rows=128, seq_len=32, partition_rows=8,
                               rows_per_shard=4)
    repo = str(pathlib.Path(__file__).resolve().parents[1])
    argv = shlex.split(command.replace("runs/mine", run))
    assert argv[0] == "actx"
    job = subprocess.Popen([sys.executable, "-m", "actx.deploy.cli", *argv[1:]], cwd=repo,
                           env={**os.environ, "PYTHONPATH": repo}, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        scope = {}
        exec(compile(code, "docs/training.md (train while it extracts)", "exec"), scope)
        tokens, losses, state = scope["train"](run)
    finally:
        out, _ = job.communicate(timeout=300)
    assert job.returncode == 0, out
    finished = reader.open_run(run)
    assert tokens == finished.manifest.total_tokens  # every token of the run, once
    assert state["next_step"] == len(losses) == -(-tokens // 128)
    assert sorted(state["commit_order"]) == list(range(len(finished.partitions)))
    quarter = len(losses) // 4
    assert np.mean(losses[-quarter:]) < np.mean(losses[:quarter])  # it learns


def test_the_torch_loader_takes_its_hook_from_the_run_and_refuses_one_it_lacks(
        tmp_path, monkeypatch):
    """docs/training.md's loader reads a hook the run has (`run.hooks`) whatever the run
    stored; a hook the run lacks is one line naming it, raised where the dataset is made
    (in the training process), not from a DataLoader worker."""
    import actx

    truth = _arc_run(tmp_path, monkeypatch)
    run = reader.open_run(truth.uri)
    code = _block(TRAINING.read_text(), "## PyTorch: your own loop")
    assert "actx.open_run(run_dir).hooks" in code and '"layers.0.resid_post"' not in code
    try:
        actx.ActivationDataset(truth.uri, "layers.99.resid_post", 256)
    except Exception as e:  # noqa: BLE001 - which error it is, is what is checked
        said = str(e)
    else:
        raise AssertionError("an unknown hook was accepted")
    assert "\n" not in said and "'layers.99.resid_post'" in said, said
    for hook in run.hooks:
        assert hook in said

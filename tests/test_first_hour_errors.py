"""Answers a user gets in their first hour that used to be wrong or unclear (issue 44),
each through the real parts (CLI, prepare, preflight, worker, reader, tiny HF checkpoints):
- `--only` naming partitions a run does not have: exit 2 even on a run with every
  partition committed (rerun used to say "nothing to do", exit 0);
- seq_len beyond the model's positions: the advice names seq_len, not max_context;
- inputs without the text field: the reason names text_field and the keys/columns found;
- gs:// without google-cloud-storage, torch_data without torch: one line naming the extra;
  reader.trainers imports (and exports for SAELens) without torch;
- export_saelens: bfloat16 refused before writing; one hook's hook_name / d_in plain;
- normalize="sqrt_d_mean_norm" (old name "unit_mean_norm"): mean norm sqrt(hidden).
"""

from __future__ import annotations

import io
import os

import pytest

from actx.deploy import cli
from tests import hf_models, reader_fixtures


@pytest.fixture
def committed_run(tmp_path) -> str:
    """A run of 8 partitions, every one committed (real commit markers and arrays)."""
    return reader_fixtures.build_run(str(tmp_path / "run"), num_partitions=8,
                                     committed=tuple(range(8))).uri


def _cli(*argv) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(list(argv), out=out)
    return code, out.getvalue()


# Every target's rerun goes through the same selection; verify checks its own --only.
ABSENT_ONLY = {
    "rerun local": ["rerun", "--target", "local"],
    "rerun tpu-vm": ["rerun", "--target", "tpu-vm"],
    "rerun dataflow": ["rerun", "--target", "dataflow"],
    "verify": ["verify"],
}


@pytest.mark.parametrize("name", list(ABSENT_ONLY))
def test_only_naming_absent_partitions_exits_2_on_a_complete_run(committed_run, name,
                                                                   capsys):
    command, *extra = ABSENT_ONLY[name]
    code, said = _cli(command, committed_run, "--only", "3,4242", *extra)
    said += capsys.readouterr().err
    assert code == 2, said
    assert "--only: partition(s) [4242] do not exist (the run has 8 partition(s), 0..7)" \
        in said, said
    assert "nothing to do" not in said


def test_rerun_only_of_present_committed_partitions_is_still_nothing_to_do(committed_run):
    code, said = _cli("rerun", committed_run, "--only", "3,7")
    assert code == 0, said
    assert "nothing to do" in said


# -- a context longer than the model's positions names the setting to change --------------
@pytest.fixture(scope="module")
def model_32_positions(tmp_path_factory) -> str:
    """A tiny Qwen2 checkpoint (save_pretrained) declaring max_position_embeddings=32."""
    return hf_models.make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "qwen2", "qwen2",
                                          num_hidden_layers=1, max_position_embeddings=32)


def _spec(model: str, tmp_path, **packing):
    from actx.schemas import runspec

    return runspec.RunSpec.from_dict({
        "model": {"path": model}, "tokenizer": {"path": "unused"},
        "sources": [{"kind": "text", "paths": [str(tmp_path / "none.jsonl")]}],
        "packing": packing, "capture": {"hooks": "layers.0.resid_post"}})


def _preflight_problems(spec) -> list[str]:
    from actx.workers import preflight

    return [p for p in preflight.check_job(spec).problems if "max_position_embeddings" in p]


def test_seq_len_beyond_the_models_positions_is_what_the_advice_names(model_32_positions,
                                                                      tmp_path):
    """seq_len 64 on a 32-position model: the advice is to lower seq_len (lowering
    max_context alone cannot work: it must be at least seq_len); followed, it passes."""
    from actx.pipeline import main as prepare_main, prepare_refusals

    spec = _spec(model_32_positions, tmp_path, seq_len=64)
    expected = "packing.seq_len=64 is larger than the model's max_position_embeddings=32"
    [problem] = _preflight_problems(spec)
    assert expected in problem and "set packing.seq_len to at most 32" in problem, problem
    with pytest.raises(prepare_refusals.PrepareError) as e:
        prepare_main.run_prepare(spec, str(tmp_path / "run"))
    assert expected in str(e.value) and "set packing.seq_len to at most 32" in str(e.value)
    assert not (tmp_path / "run").exists()
    # What the old advice said to do is refused by the spec itself; what the new one says
    # passes the same checks.
    with pytest.raises(ValueError, match="max_context: must be at least seq_len"):
        _spec(model_32_positions, tmp_path, seq_len=64, max_context=32)
    # A model of fewer positions than the default max_context (4096): both come down.
    assert "and packing.max_context to at most 32" in problem, problem
    assert _preflight_problems(_spec(model_32_positions, tmp_path, seq_len=32,
                                     max_context=32)) == []


def test_seq_len_advice_on_a_model_of_more_positions_than_the_default(tmp_path_factory,
                                                                      tmp_path):
    """The issue's case: seq_len 8192 on a 4096-position model. Lowering seq_len to 4096
    (max_context left to its default) is all it takes, and the advice says so."""
    model = hf_models.make_tiny_checkpoint(tmp_path_factory.mktemp("m4096") / "q", "qwen2",
                                           num_hidden_layers=1, max_position_embeddings=4096)
    [problem] = _preflight_problems(_spec(model, tmp_path, seq_len=8192))
    assert "packing.seq_len=8192 is larger than the model's max_position_embeddings=4096" \
        in problem and "set packing.seq_len to at most 4096" in problem, problem
    assert "(and packing.max_context, if you set it, to at most 4096)" in problem, problem
    assert _preflight_problems(_spec(model, tmp_path, seq_len=4096)) == []


def test_max_context_alone_beyond_the_models_positions_names_max_context(model_32_positions,
                                                                         tmp_path):
    spec = _spec(model_32_positions, tmp_path, seq_len=16, max_context=48)
    [problem] = _preflight_problems(spec)
    assert "packing.max_context=48 is larger than the model's max_position_embeddings=32" \
        in problem and "set packing.max_context to at most 32" in problem, problem
    assert "seq_len to at most" not in problem
    assert _preflight_problems(_spec(model_32_positions, tmp_path, seq_len=16,
                                     max_context=32)) == []


def test_the_worker_gives_the_same_advice(model_32_positions, tmp_path):
    """A run prepared before the check (written here by the real packer) is refused by the
    worker itself with seq_len named."""
    from actx.schemas import worker_options
    from actx.workers.loop import runner
    from tests import token_runs

    run = str(tmp_path / "run")
    token_runs.write_long_document_run(run, model_32_positions, seq_len=48, max_context=48,
                                       hooks="layers.0.resid_post")
    with pytest.raises(ValueError, match=r"packing\.seq_len=48 is larger than the model's "
                                         r"max_position_embeddings=32 .*set packing\.seq_len "
                                         r"to at most 32"):
        runner.Worker(worker_options.WorkerOptions(run=run))


# -- inputs without the text field name text_field and what they hold --------------------
def _prepare_spec(tokenizer: str, path: str):
    from actx.schemas import runspec

    return runspec.RunSpec.from_dict({
        "name": "nofield", "model": {"path": ""}, "tokenizer": {"path": tokenizer},
        "sources": [{"kind": "text", "paths": [path]}],
        "packing": {"mode": "segmented", "seq_len": 16},
        "layout": {"rows_per_shard": 2, "partition_rows": 4}})


def _recorded_rejects(run: str) -> list[dict]:
    import json

    found = []
    for root, _, files in os.walk(os.path.join(run, "rejects")):
        for name in sorted(files):
            with open(os.path.join(root, name)) as f:
                found += [json.loads(line) for line in f if line.strip()]
    return found


def test_a_parquet_without_the_text_column_says_so_once_naming_its_columns(
        qwen_tokenizer_dir, tmp_path, capsys):
    """A parquet of 6 rows whose text is in 'content': prepare refuses it with one reason
    (not six), naming text_field and the file's columns; each row is still a recorded
    reject with that reason."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from actx.pipeline import main as prepare_main, prepare_refusals

    path = str(tmp_path / "docs.parquet")
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(6)],
                             "content": [f"document {i}" for i in range(6)]}), path)
    run = str(tmp_path / "run")
    with pytest.raises(prepare_refusals.PrepareError) as e:
        prepare_main.run_prepare(_prepare_spec(qwen_tokenizer_dir, path), run)
    reason = ("parquet file has no text column 'text', its columns are ['id', 'content'] - "
              "set the source's text_field to the column that holds the text")
    said = str(e.value)
    assert "no input was accepted (6 of 6 rejected)" in said, said
    assert said.count(reason) == 1 and f"{reason}: 6" in said, said
    rejects = _recorded_rejects(run)
    assert [r["row"] for r in rejects] == list(range(6))
    assert {r["reason"] for r in rejects} == {reason} and {r["file"] for r in rejects} == {path}
    # `actx status` on the refused run says what the prepare refused and where the
    # rejects are (it said "not an actx run ... run `actx prepare`", which needs flags).
    import io

    from actx.deploy import cli

    assert cli.main(["status", run], out=io.StringIO()) == 2
    said = capsys.readouterr().err
    assert (f"{run}: not prepared: its prepare left no run.json, having accepted 0 of 6 "
            f"input document(s) ({reason}: 6); the rejected inputs, each with its reason, "
            f"are in {run}/rejects") in said, said
    assert "`actx prepare`" not in said


def test_a_jsonl_line_without_the_text_key_names_text_field_and_its_keys(qwen_tokenizer_dir,
                                                                         tmp_path):
    import json

    from actx.pipeline import main as prepare_main

    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "a document that is fine"}) + "\n"
                    + json.dumps({"body": "its text is under another key", "id": 2}) + "\n")
    run = str(tmp_path / "run")
    manifest = prepare_main.run_prepare(_prepare_spec(qwen_tokenizer_dir, str(path)), run,
                                        max_reject_fraction=1.0)
    assert [(c.accepted, c.rejected) for c in manifest.sources.values()] == [(1, 1)]
    [reject] = _recorded_rejects(run)
    assert reject["line"] == 2 and reject["reason"] == (
        "missing text field 'text', this line's keys are ['body', 'id'] - set the source's "
        "text_field to the key that holds the text")


# -- a missing install is one line naming the extra --------------------------------------
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Runs the code after it as if the packages named in argv[1] (comma-separated) were not
# installed: the path finder does not see them, so `import` raises ModuleNotFoundError and
# importlib.util.find_spec answers None, as on an install without them.
NOT_INSTALLED = """
import importlib.machinery, sys
BLOCKED = sys.argv.pop(1).split(",")
def _blocked(name):
    return any(name == b or name.startswith(b + ".") for b in BLOCKED)
class _NotInstalled:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        return None if _blocked(name) else self.finder.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.finder, attr)
sys.meta_path[:] = [_NotInstalled(f) if f is importlib.machinery.PathFinder else f
                    for f in sys.meta_path]
"""


def _without(packages: str, code: str, *argv: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", NOT_INSTALLED + code, packages, *argv],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                          capture_output=True, text=True, timeout=300)


def test_gs_without_google_cloud_storage_is_one_line_naming_the_gcs_extra():
    from actx.schemas import version

    cli_main = "import sys, runpy; sys.argv = ['actx', *sys.argv[1:]]; " \
               "runpy.run_module('actx.deploy.cli', run_name='__main__')"
    for command in ("status", "verify"):
        done = _without("google.cloud.storage", cli_main, command, "gs://some-bucket/run")
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
        assert f"pip install '{version.DISTRIBUTION}[gcs]'" in done.stderr
        assert "google-cloud-storage" in done.stderr


def test_reader_trainers_imports_and_exports_without_torch(tmp_path):
    """`import actx.reader.trainers` and the SAELens export (HF datasets, no torch) on an
    install without torch; the export is read back and holds the run's values."""
    truth = reader_fixtures.build_run(str(tmp_path / "run"), committed=(0, 1, 2))
    out = str(tmp_path / "cache")
    done = _without("torch", """
import json, sys
from actx.reader import trainers
info = trainers.export_saelens(sys.argv[1], "layers.0.resid_post", sys.argv[2],
                               context_size=8)
print(json.dumps({"info": info, "torch": "torch" in sys.modules}))
""", truth.uri, out)
    assert done.returncode == 0, done.stderr
    import json

    said = json.loads(done.stdout.splitlines()[-1])
    assert said["torch"] is False
    info = said["info"]
    assert info["hook_name"] == "blocks.0.hook_resid_post" and info["d_in"] == truth.hidden
    datasets = pytest.importorskip("datasets")
    import numpy as np

    acts = np.asarray(datasets.load_from_disk(out)["blocks.0.hook_resid_post"], np.float32)
    flat = reader_fixtures.decode_flat(acts.reshape(-1, truth.hidden), truth.seq_len)
    np.testing.assert_array_equal(acts.reshape(-1, truth.hidden),
                                  truth.value("layers.0.resid_post", flat // truth.seq_len,
                                              flat % truth.seq_len))


def test_torch_data_without_torch_is_one_line_naming_the_torch_extra():
    done = _without("torch", """
from actx.schemas import errors
try:
    import actx.reader.torch_data
except ImportError as e:
    print("user error" if isinstance(e, errors.UserError) else "other", str(e), sep="|")
""")
    assert done.returncode == 0, done.stderr
    kind, message = done.stdout.strip().split("|")
    assert kind == "user error" and "\\n" not in message
    assert "needs PyTorch" in message and "pip install 'actx-lm[torch]'" in message, message


# -- export_saelens: dtypes it can store, one hook's plain names --------------------------
def test_export_saelens_refuses_bfloat16_before_writing_anything(tmp_path):
    pytest.importorskip("datasets")
    from actx.reader import trainers

    truth = reader_fixtures.build_run(str(tmp_path / "run"), committed=(0, 1, 2))
    out = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"dtype 'bfloat16': .* takes float32, float16, "
                                         r"float64"):
        trainers.export_saelens(truth.uri, "layers.0.resid_post", str(out), dtype="bfloat16")
    assert not out.exists()


def test_export_saelens_names_one_hook_plainly_and_several_by_column(tmp_path):
    pytest.importorskip("datasets")
    from actx.reader import trainers

    truth = reader_fixtures.build_run(str(tmp_path / "run"), committed=(0, 1, 2),
                                      hidden=12)
    one = trainers.export_saelens(truth.uri, ["layers.0.resid_post"], str(tmp_path / "a"),
                                  context_size=8, dtype="float16")
    assert one["hook_name"] == "blocks.0.hook_resid_post" and one["d_in"] == 12
    assert isinstance(one["d_in"], int) and one["hook_names"] == ["blocks.0.hook_resid_post"]
    both = trainers.export_saelens(truth.uri, ["layers.0.resid_post", "embed"],
                                   str(tmp_path / "b"), context_size=8)
    assert "hook_name" not in both
    assert both["hook_names"] == ["blocks.0.hook_resid_post", "hook_embed"]
    assert both["d_in"] == {"blocks.0.hook_resid_post": 12, "hook_embed": 12}


# -- normalisation: the option's name says what it does -----------------------------------
def test_sqrt_d_mean_norm_gives_a_mean_norm_of_sqrt_hidden_and_keeps_its_old_name(tmp_path):
    """The scale is checked against the norms of the batches themselves: over one epoch of
    every kept token the mean L2 norm is sqrt(hidden); the old name gives the same values."""
    import numpy as np

    from actx import reader

    truth = reader_fixtures.build_run(str(tmp_path / "run"), committed=(0, 1, 2),
                                      random_values=True, hidden=8)
    run = reader.open_run(truth.uri)
    run.compute_stats(["embed"])

    def epoch(mode):
        with run.stream(["embed"], 16, seed=0, epochs=1, drop_last=False,
                        normalize=mode) as batches:
            return np.concatenate([np.asarray(b.acts["embed"]) for b in batches])

    new, old = epoch("sqrt_d_mean_norm"), epoch("unit_mean_norm")
    np.testing.assert_array_equal(new, old)
    mean_norm = np.linalg.norm(new.astype(np.float64), axis=1).mean()
    assert abs(mean_norm - np.sqrt(8)) < 1e-4 * np.sqrt(8), mean_norm
    with pytest.raises(ValueError, match="standardize, sqrt_d_mean_norm"):
        epoch("unit_norm")


def test_the_worker_refuses_only_naming_absent_partitions(committed_run):
    """`actx extract --only` (the worker itself) exits 2 naming the ids, as rerun does."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "actx.deploy.cli", "extract", "--run",
                           committed_run, "--only", "3,4242"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--only: partition(s) [4242] do not exist (the run has 8 partition(s), 0..7)" \
        in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("packing, generate", [
    ({"seq_len": 32}, None),                                   # overflow continue
    ({"seq_len": 128, "overflow": "truncate"}, None),          # rows past the table
    ({"seq_len": 32, "max_context": 96}, {"max_new_tokens": 8}),  # answers past it
])
def test_prepare_refuses_what_passes_a_gpt2s_learned_positions_as_the_workers_do(
        tmp_path_factory, tmp_path, packing, generate):
    """A GPT-2 (n_positions in config.json, no max_position_embeddings) whose documents
    could pass its 64 learned positions: `actx prepare` refuses it before any work, with
    the pre-flight's words (before, it prepared the run and only the workers refused);
    what the advice leads to passes both."""
    from actx.pipeline import main as prepare_main, prepare_refusals
    from actx.schemas import runspec
    from actx.workers import preflight

    model = hf_models.make_tiny_checkpoint(tmp_path_factory.mktemp("gpt2") / "g", "gpt2",
                                           n_positions=64)
    spec = runspec.RunSpec.from_dict({**_spec(model, tmp_path, **packing).to_dict(),
                                      **({"generate": generate} if generate else {})})
    problems = [p for p in preflight.check_job(spec).problems if "n_positions=64" in p]
    assert problems
    with pytest.raises(prepare_refusals.PrepareError) as e:
        prepare_main.run_prepare(spec, str(tmp_path / "run"))
    assert str(e.value) == "; ".join(p.removeprefix("spec.") for p in problems)
    assert not (tmp_path / "run").exists()
    followed = {**packing, "seq_len": 32, "overflow": "truncate"} if not generate else \
        {**packing, "max_context": 64}
    spec = runspec.RunSpec.from_dict({**_spec(model, tmp_path, **followed).to_dict(),
                                      **({"generate": generate} if generate else {})})
    prepare_refusals.check_max_context(spec)
    assert [p for p in preflight.check_job(spec).problems if "n_positions" in p] == []

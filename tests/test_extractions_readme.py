"""docs/several-models.md's crosscoder workflow runs as written: its
config, its `actx` commands (prepare once, two tiny Qwen2 models with Qwen2.5's real
vocabulary extracted one after another) and its training loop over aligned batches."""

from __future__ import annotations

import io
import json
import pathlib
import re
import shutil

import numpy as np
import yaml

from actx.deploy import cli, demo

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "several-models.md"
WORDS = "the a model token layer chat base read write store run cat sat on mat".split()


def _blocks() -> tuple[str, list[str], str]:
    section = PAGE.read_text()
    config = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    shell = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    commands = [line.split("#")[0].split() for line in shell.splitlines() if line.strip()]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return config, commands, code


def test_crosscoder_workflow_runs(tmp_path, monkeypatch, qwen_tokenizer_dir):
    config, commands, code = _blocks()
    assert [c[:2] for c in commands] == [["actx", "submit"], ["actx", "status"],
                                         ["actx", "rerun"], ["actx", "verify"]]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "crosscoder.yaml").write_text(config)
    shutil.copytree(qwen_tokenizer_dir, tmp_path / "qwen2-tokenizer")
    demo.make_tiny_qwen2(str(tmp_path / "models" / "base"), seed=0)
    demo.make_tiny_qwen2(str(tmp_path / "models" / "chat"), seed=1)  # other weights
    rng = np.random.default_rng(0)
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"id": str(i), "text": " ".join(
                rng.choice(WORDS, int(rng.integers(5, 40))))}) + "\n")
    outputs = []
    for argv in commands:
        out = io.StringIO()
        assert cli.main(argv[1:], out=out) == 0, out.getvalue()
        outputs.append(out.getvalue())
    submit, status, rerun, verify = outputs
    run = tmp_path / "runs" / "crosscoder"
    n = len(json.loads((run / "manifest.json").read_text())["partitions"]["id"])
    assert n >= 2
    for text in (submit, status):
        assert "2 extractions over one token store:" in text
        for name in ("base", "chat"):
            assert re.search(rf"^  {name}\s+{n}/{n} committed, 0 in progress", text, re.M)
    assert "nothing to do" in rerun
    assert "== extraction base ==" in verify and "== extraction chat ==" in verify
    assert not (run / "activations").exists()  # only the named extractions ran
    # Each extraction's hosts beat under its own name (its status shows its own hosts).
    assert (run / "extractions" / "chat" / "workers").is_dir() and not (run / "workers").exists()

    scope: dict = {}
    exec(compile(code, "docs/several-models.md (crosscoder)", "exec"), scope)
    b, batches = scope["b"], scope["batches"]
    assert b.step == 2 * batches.steps_per_epoch - 1 and tuple(b.acts.shape[1:]) == (2, 64)
    assert np.isfinite(float(scope["loss"].detach()))
    # Each column is its own model's activation of the same token, scaled by that model's
    # own mean norm (computed here with numpy over every stored token).
    from actx import reader

    for i, name in enumerate(("base", "chat")):
        r = reader.open_run(str(run), extraction=name)
        acts = r.rows("layers.1.resid_post", 0, r.total_rows).astype(np.float64)
        valid = r.token_rows("segment_ids", 0, r.total_rows) > 0
        mean_norm = np.linalg.norm(acts[valid], axis=-1).mean()
        want = r.gather(["layers.1.resid_post"], b.rows, b.cols)["layers.1.resid_post"]
        np.testing.assert_allclose(b.acts[:, i].numpy(), want * np.sqrt(64) / mean_norm,
                                   rtol=1e-4, atol=1e-5)

    # The same config with both models in memory at once (`target.models_at_once: 2`, the
    # the page's words): the same bytes in each extraction.
    out = io.StringIO()
    assert cli.main(["submit", "crosscoder.yaml", "--run", "runs/together",
                     "--set", "target.models_at_once=2"], out=out) == 0, out.getvalue()
    logs = "".join(p.read_text() for p in (tmp_path / "runs" / "together" / "logs").rglob(
        "*.log"))
    assert "extracting 'base', 'chat' at once" in logs, logs[-3000:]
    compared = 0
    for name in ("base", "chat"):
        for path in (run / "extractions" / name / "activations").rglob("*"):
            if path.is_file() and path.name != "actx.json":
                other = tmp_path / "runs" / "together" / path.relative_to(run)
                assert other.read_bytes() == path.read_bytes(), path
                compared += 1
    assert compared >= 4


def test_a_model_of_another_vocabulary_is_refused(tmp_path, monkeypatch, qwen_tokenizer_dir):
    """The tokenizer check applies per model: an extraction whose model has another
    vocabulary is refused before anything is prepared."""
    config, _, _ = _blocks()
    monkeypatch.chdir(tmp_path)
    data = yaml.safe_load(config)
    (tmp_path / "crosscoder.yaml").write_text(yaml.safe_dump(data))
    shutil.copytree(qwen_tokenizer_dir, tmp_path / "qwen2-tokenizer")
    demo.make_tiny_qwen2(str(tmp_path / "models" / "base"), seed=0)
    demo.make_tiny_qwen2(str(tmp_path / "models" / "chat"), seed=1, vocab_size=1000)
    (tmp_path / "docs.jsonl").write_text('{"id": "0", "text": "a b c"}\n')
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    assert cli.main(["submit", "crosscoder.yaml"], out=io.StringIO()) == 2
    assert "extractions.chat:" in err.getvalue(), err.getvalue()
    assert not (tmp_path / "runs" / "crosscoder").exists()

"""docs/several-models.md's model diffing across training runs as written: three tiny
GPT-NeoX (Pythia-shaped) checkpoints of one model, each a few steps from the last and all
with one GPT-2-style tokenizer, extract over one token store, and the aligned stream pairs
the same tokens across the checkpoints (each column is that step's own stored
activation of that token, and the first token of each document equals HF's GPT-NeoX
run on that checkpoint)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil

import numpy as np

from actx.deploy import cli
from tests import hf_models, tokenizer_families
from tests.test_readme import DOCS, blocks, section

STEPS = ("step1000", "step8000", "step143000")
WORDS = "the a model token layer step train read write store run cat sat on mat".split()


def _blocks() -> tuple[str, list[list[str]], str]:
    text = section(DOCS / "several-models.md",
                   "## Model diffing across training (Pythia's checkpoints)")
    [config], [shell], [code] = (blocks(text, lang) for lang in ("yaml", "sh", "python"))
    commands = [line.split("#")[0].split() for line in shell.splitlines() if line.strip()]
    return config, commands, code


def _checkpoints(root) -> None:
    """pythia/<step> for each step: one model's weights, each step the last plus a small
    random update (as training moves them), with the same tokenizer in every directory,
    as Pythia's revisions ship it."""
    from safetensors.numpy import load_file, save_file

    tokenizer = tokenizer_families.make_family("gpt2")
    # Pythia pads its embedding past the tokenizer (50,277 ids, 50,304 rows).
    rows = -(-len(tokenizer) // 64) * 64
    first = root / STEPS[0]
    hf_models.make_tiny_checkpoint(first, "gpt_neox", num_hidden_layers=2, vocab_size=rows,
                                   bos_token_id=0, eos_token_id=0)
    rng = np.random.default_rng(0)
    for before, step in zip(STEPS, STEPS[1:]):
        shutil.copytree(root / before, root / step)
        file = os.path.join(root / step, "model.safetensors")
        tensors = load_file(file)
        for name, value in tensors.items():
            tensors[name] = (value + 0.3 * value.std() * rng.standard_normal(value.shape)
                             ).astype(value.dtype)
        save_file(tensors, file, metadata={"format": "pt"})
    for step in STEPS:
        tokenizer.save_pretrained(str(root / step))


def test_model_diffing_across_training_runs(tmp_path, monkeypatch, capsys):
    config, commands, code = _blocks()
    assert [c[:2] for c in commands] == [["actx", "submit"], ["actx", "status"]]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "training.yaml").write_text(config)
    _checkpoints(tmp_path / "pythia")
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
    run = tmp_path / "runs" / "training"
    n = len(json.loads((run / "manifest.json").read_text())["partitions"]["id"])
    assert n >= 2
    assert "3 extractions over one token store:" in outputs[1]
    for step in STEPS:
        assert re.search(rf"^  {step}\s+{n}/{n} committed", outputs[1], re.M), outputs[1]

    scope: dict = {}
    exec(compile(code, "docs/several-models.md (model diffing across training)", "exec"),
         scope)
    printed = capsys.readouterr().out
    moved, b = scope["moved"], scope["b"]

    from actx import reader

    runs = {step: reader.open_run(str(run), extraction=step) for step in STEPS}
    first = runs[STEPS[0]]
    valid = first.token_rows("segment_ids", 0, first.total_rows) > 0
    assert len(moved) == int(valid.sum()) and f"{len(moved)} tokens" in printed
    # The last batch pairs one token across the steps: each column is its step's own.
    for i, step in enumerate(STEPS):
        want = runs[step].gather(["layers.1.resid_post"], b.rows, b.cols)[
            "layers.1.resid_post"]
        np.testing.assert_array_equal(np.asarray(b.acts[:, i]), want)
    # The cosines are those of the stored activations of each (row, column).
    rows, cols = np.nonzero(valid)
    acts = [runs[s].gather(["layers.1.resid_post"], rows, cols)["layers.1.resid_post"]
            for s in STEPS]
    unit = [a / np.linalg.norm(a, axis=-1, keepdims=True) for a in acts]
    for j, (r, c) in enumerate(zip(rows[:50], cols[:50])):
        np.testing.assert_allclose(moved[(int(r), int(c))],
                                   [unit[0][j] @ unit[1][j], unit[1][j] @ unit[2][j]],
                                   rtol=1e-5)
    # The steps differ (training moved them), and each is its own checkpoint's: a
    # document's tokens equal HF's GPT-NeoX run on that checkpoint.
    assert np.mean(list(moved.values())) < 0.999
    ids = first.token_rows("input_ids", 0, 1)[0]
    seg = first.token_rows("segment_ids", 0, 1)[0]
    doc = ids[seg == seg[0]]
    for step in STEPS:
        hf = hf_models.load_hf_model(str(tmp_path / "pythia" / step))
        ref = hf_models.hf_hooks(hf, doc[None])["layers.1.resid_post"][0]
        got = runs[step].rows("layers.1.resid_post", 0, 1)[0][:len(doc)]
        assert float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))) <= 1e-5, step

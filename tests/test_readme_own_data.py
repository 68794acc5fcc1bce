"""README's "Your own data in five minutes" runs as written: its config (a JSONL whose text
is under `body`, an HF checkpoint directory), its `actx` commands and its Python (read, then
train a small SAE), on a tiny Qwen2 checkpoint with Qwen2.5's real tokenizer. What it
stores is checked against HF: each document's tokens are the tokenizer's, and its
activations are what transformers computes on the document alone."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np

from actx.deploy import cli, demo
from tests import hf_models, worker_procs
from tests.test_readme import README, blocks, section

WORDS = "dear diary the model read a long note about tokens layers and sparse codes".split()


def test_own_data_walkthrough_runs_as_written(tmp_path, monkeypatch, qwen_tokenizer_dir):
    text = section(README, "## Your own data in five minutes")
    [config], [shell], [code] = blocks(text, "yaml"), blocks(text, "sh"), blocks(text, "python")
    commands = [line.split("#")[0].split() for line in shell.splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["actx", "submit"], ["actx", "status"],
                                         ["actx", "verify"]]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-run.yaml").write_text(config)
    model = tmp_path / "models" / "my-model"  # an HF checkpoint directory with its tokenizer
    demo.make_tiny_qwen2(str(model), seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{qwen_tokenizer_dir}/{name}", model / name)
    rng = np.random.default_rng(0)
    bodies = [" ".join(rng.choice(WORDS, int(rng.integers(5, 60)))) for _ in range(40)]
    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / "notes.jsonl", "w") as f:  # no `text` key: text_field
        for i, body in enumerate(bodies):
            f.write(json.dumps({"id": f"n{i}", "body": body}) + "\n")

    outputs = []
    for argv in commands:
        out = io.StringIO()
        assert cli.main(argv[1:], out=out) == 0, out.getvalue()
        outputs.append(out.getvalue())
    assert "phase:      finished" in outputs[1]

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny SAE: torch's thread pool only contends on 2 cores
    try:
        scope: dict = {}
        exec(compile(code, "README.md (your own data)", "exec"), scope)
    finally:
        torch.set_num_threads(threads)
    losses, d = scope["losses"], scope["d"]
    assert len(losses) >= 20 and np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    assert tuple(scope["x"].shape) == (64, d)

    # What was stored is the model's own: tokens as HF's tokenizer gives them (Qwen adds no
    # BOS), activations as transformers computes them on each document alone.
    from tokenizers import Tokenizer

    from actx import reader

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    run = reader.open_run("runs/mine")
    hf = hf_models.load_hf_model(model)
    for i in (0, 17, 39):
        doc = run.document(f"n{i}", ["layers.0.resid_post", "layers.1.resid_post"])
        want = tokenizer.encode(bodies[i]).ids
        assert doc.input_ids.tolist() == want, i
        reference = hf_models.hf_hooks(hf, np.asarray(want)[None])
        for hook, values in doc.acts.items():
            worker_procs.assert_close(values, reference[hook][0], 1e-5, f"n{i} {hook}")

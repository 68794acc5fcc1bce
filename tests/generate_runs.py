"""Generating runs for the tests: a tiny Qwen2 with Qwen2.5's real vocabulary, prompts
with the real tokenizer, a real Beam prepare and a real worker process
(tests/test_generate_run.py, test_generate_status.py, test_generate_targets.py)."""

from __future__ import annotations

import json

from actx.pipeline import main as prepare_main
from actx.schemas import commit, runspec, store
from tests import hf_models, worker_procs

HOOKS = "layers.0.resid_post,layers.1.resid_post,final_norm"
# ',' (id 11): the prompt that ends in a list makes the tiny model write it first, so its
# samples stop on it and the others run to max_new_tokens.
STOP = 11
PROMPTS = ["The cat sat on the mat and", "Once upon a time " * 12, "1 2 3 4 5", "Hello",
           "A list: apples, pears, plums, figs,"]


def tiny_qwen2(path) -> str:
    """The random tiny Qwen2 every generating test runs (2 layers, 151,936 ids)."""
    return hf_models.make_tiny_checkpoint(path, "qwen2", vocab_size=151936,
                                          num_hidden_layers=2)


def write_prompts(path, prompts=PROMPTS) -> str:
    """A JSONL text source of `prompts`, with ids q0, q1, ..."""
    path.write_text("".join(json.dumps({"id": f"q{i}", "text": t}) + "\n"
                            for i, t in enumerate(prompts)))
    return str(path)


def spec_dict(model: str, tokenizer: str, prompts: str, *, seq_len: int = 32,
              max_context: int = 160, rows_per_shard: int = 2, partition_rows: int = 4,
              **generate) -> dict:
    """A generating spec over `prompts` (rows short enough that prompts and answers cross
    rows and partitions); `generate`: the section's keys."""
    return {
        "model": {"path": model, "dtype": "float32"}, "tokenizer": {"path": tokenizer},
        "sources": [{"kind": "text", "paths": [prompts]}],
        "packing": {"mode": "segmented", "seq_len": seq_len, "max_context": max_context},
        "capture": {"hooks": HOOKS, "dtype": "float32"},
        "layout": {"rows_per_shard": rows_per_shard, "partition_rows": partition_rows},
        "generate": generate}


def generated_run(run: str, spec: runspec.RunSpec, batch_size: int = 4):
    """Prepares `run` for `spec` and generates it with one worker process; its manifest."""
    m = prepare_main.run_prepare(spec, run, ["--runner=FnApiRunner"])
    assert m.docs_rejected == 0
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", str(batch_size)],
                                        devices=1)
    assert code == 0, out
    assert commit.committed_partitions(store.open_store(run)) == {p.id for p in m.partitions}
    return m

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


def records(run: str) -> dict[int, dict]:
    """Every stored sample record (generated/p-*.json) by doc_index, with the record's
    stop_token_ids."""
    import json as json_lib

    from actx.schemas import layout

    s = store.open_store(run)
    out = {}
    for key in s.list(layout.GENERATED_PREFIX):
        record = json_lib.loads(s.read(key))
        assert record["version"] == layout.GENERATED_VERSION
        out.update((e["doc_index"], {**e, "stop_token_ids": record["stop_token_ids"]})
                   for e in record["samples"])
    return out


def stored_run(run: str) -> dict[str, bytes]:
    """What a generating run stored that must be the same bytes however it was run: every
    activation array's chunks and metadata (not the numerics record, which names the
    hosts and devices) and the sample records."""
    objects = {**worker_procs.stored_objects(run), **worker_procs.stored_objects(run,
                                                                                "generated")}
    return {k: v for k, v in objects.items() if not k.endswith("actx.json")}


def assert_every_token_is_hf(run: str, model: str, tokenizer_dir: str, prompts: list[str],
                             max_new: int, stop: int, samples_per_prompt: int = 1,
                             greedy: bool = True, **generate_kwargs) -> dict[int, tuple]:
    """Every sample's stored tokens and activations against HF transformers: its prompt
    is HF's tokenizer's, (greedy) its answer is HF `generate`'s, and every hook of every
    token, prompt and generated, is HF's forward over prompt + answer (fp32, 1e-5); the
    room it did not reach holds zeros. generate_kwargs: HF generate's further settings
    (the run's repetition_penalty). Returns {document: (rows, cols, its record)}, its
    tokens' places in position order, for a caller's further checks."""
    import numpy as np
    import torch
    import transformers

    from actx.schemas import layout
    from tests import token_runs

    hf = hf_models.load_hf_model(model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    input_ids = token_runs.read_tokens(run, "input_ids")
    doc_index = token_runs.read_tokens(run, "doc_index")
    positions = token_runs.read_tokens(run, "positions")
    generated_ids = token_runs.read_activation(run, layout.GENERATED_IDS)[..., 0]
    acts = {h: token_runs.read_activation(run, h) for h in HOOKS.split(",")}
    found, checked = records(run), {}
    assert sorted(found) == list(range(len(prompts) * samples_per_prompt))
    for d, e in found.items():
        where = np.nonzero(doc_index == d)
        order = np.argsort(positions[where])
        r, c = where[0][order], where[1][order]
        prompt = input_ids[r, c][:e["prompt_tokens"]]
        assert list(prompt) == tokenizer(prompts[e["prompt_doc"] // samples_per_prompt])[
            "input_ids"]
        answer = np.asarray(e["generated_ids"], np.int64)
        if greedy:
            out = hf.generate(torch.tensor(prompt[None]), max_new_tokens=max_new,
                              do_sample=False, eos_token_id=stop, pad_token_id=0,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              **generate_kwargs)
            assert answer.tolist() == out[0, len(prompt):].tolist(), f"document {d}"
        assert e["text"] == tokenizer.decode(answer)
        text = np.concatenate([prompt, answer])
        n = len(text)
        reference = hf_models.hf_hooks(hf, text[None])
        for hook, values in acts.items():
            worker_procs.assert_close(values[r[:n], c[:n]], reference[hook][0], 1e-5,
                                      f"document {d} {hook}")
            assert not values[r[n:], c[n:]].any()
        g = generated_ids[r, c]
        assert (g[:len(prompt)] == layout.GENERATED_PROMPT).all()
        assert g[len(prompt):n].tolist() == answer.tolist()
        assert (g[n:] == layout.GENERATED_UNUSED).all()
        checked[d] = (r, c, e)
    return checked

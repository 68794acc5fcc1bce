"""`actx verify RUN --reference`, on a checkpoint made the way released models are: sharded
bf16 safetensors with model.safetensors.index.json, generation_config.json,
chat_template.jinja, and chat tokens added to the tokenizer after training (the embedding
resized for them). The run goes from `actx submit` (prose documents, some past
max_context, and ARC prompts through the template) to `verify --reference`, which
recomputes sampled documents with HF transformers alone and passes; a run whose stored
values were changed together with their checksums passes a plain verify and fails
`--reference`, naming the document, partition, hook and error."""

from __future__ import annotations

import io
import json
import os
import pathlib
import re
import shutil
import sys

import numpy as np
import pytest
import yaml

from actx.deploy import cli
from actx.schemas import commit, layout, reference_verification, store, ts_context, uri
from tests import hf_models
from tests import tokenizer_families as families

HOOKS = ("embed,layers.*.resid_post,layers.1.attn_out,layers.1.mlp_out,layers.2.resid_mid,"
         "final_norm")
MAX_CONTEXT = 24
TAMPERED = "layers.1.resid_post"


def make_release_checkpoint(path) -> str:
    """A Llama-3-architecture instruct checkpoint as releases ship one (see the module's
    doc), with its tokenizer in the same directory."""
    import torch
    import transformers

    tok = families.make_family("llama3")  # 400 trained ids, then 5 special tokens
    config = hf_models.tiny_config("llama3", vocab_size=400)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.resize_token_embeddings(len(tok))  # chat tokens added after training
    bos, eot = tok.convert_tokens_to_ids(["<|begin_of_text|>", "<|eot_id|>"])
    end = tok.convert_tokens_to_ids("<|end_of_text|>")
    model.config.bos_token_id, model.config.eos_token_id = bos, end
    model.generation_config = transformers.GenerationConfig(bos_token_id=bos,
                                                            eos_token_id=[end, eot])
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="100KB")
    tok.save_pretrained(path)
    return os.fspath(path)


def _cli(*argv) -> tuple[int, str]:
    out = io.StringIO()
    return cli.main([str(a) for a in argv], out=out), out.getvalue()


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(checkpoint, run): the checkpoint and a run `actx submit` made from it."""
    root = tmp_path_factory.mktemp("released")
    ckpt = make_release_checkpoint(root / "ckpt")
    texts = root / "texts.jsonl"
    lengths = [3, 40, 9, 70, 5, 17, 2, 33]  # words; several past max_context in tokens
    texts.write_text("".join(json.dumps({"id": f"d{i}", "text": " ".join(
        families.CORPUS[i].split()[:1] + ["grids"] * n)}) + "\n" for i, n in enumerate(lengths)))
    arc = root / "arc.jsonl"
    arc.write_text(json.dumps({"task_id": "a1", "train": [
        {"input": [[1, 2], [3, 4]], "output": [[4, 3], [2, 1]]}],
        "test": [{"input": [[0, 5], [5, 0]]}]}) + "\n")
    config = root / "submit.yaml"
    config.write_text(yaml.safe_dump({
        "run": str(root / "run"),
        "spec": {"name": "released", "model": {"path": ckpt, "dtype": "float32"},
                 "tokenizer": {"path": ckpt},
                 "sources": [{"kind": "text", "paths": [str(texts)]},
                             {"kind": "arc", "paths": [str(arc)]}],
                 "packing": {"mode": "segmented", "seq_len": 16, "max_context": MAX_CONTEXT},
                 "capture": {"hooks": HOOKS, "dtype": "float32"},
                 "layout": {"rows_per_shard": 2, "partition_rows": 4}},
        "target": {"kind": "local", "hosts": 1, "batch_size": 2}}))
    code, out = _cli("submit", config)
    assert code == 0, out
    return ckpt, str(root / "run")


def test_the_checkpoint_is_made_as_releases_are(released):
    ckpt, run = released
    files = set(os.listdir(ckpt))
    assert {"model.safetensors.index.json", "generation_config.json", "chat_template.jinja",
            "tokenizer.json", "tokenizer_config.json"} <= files
    shards = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    assert len(set(shards.values())) > 1 and "model.safetensors" not in files
    assert json.load(open(os.path.join(ckpt, "config.json")))["dtype"] == "bfloat16"
    recorded = json.load(open(os.path.join(run, "run.json")))["tokenizer_identity"]
    assert recorded["chat_template"] == "chat_template.jinja"
    assert recorded["prepended"] == [400] and recorded["prepended_templated"] == []


def test_a_clean_run_passes_and_is_recorded(released):
    ckpt, run = released
    code, out = _cli("verify", run, "--reference")
    assert code == 0, out
    assert "OK: every stored value of the sample equals the model's own" in out
    record = reference_verification.read_record(store.open_store(run))
    assert record.ok and record.tolerance == 1e-4 and not record.failures
    assert set(record.hooks) == set(json.load(open(os.path.join(
        run, layout.ACTIVATIONS_INFO_KEY)))["hooks"]) and len(record.hooks) >= 5
    assert len(record.documents) == 4
    assert any(d.past_max_context for d in record.documents)  # long documents included
    assert 0 < max(record.hooks.values()) < 1e-4
    assert record.summary().startswith("reference: OK: 4 document(s), ")


def test_values_altered_with_their_checksums_fail_only_the_reference(released, tmp_path):
    _, clean = released
    run = shutil.copytree(clean, tmp_path / "run")
    _alter(str(run), TAMPERED, factor=1.01)
    code, out = _cli("verify", run)
    assert code == 0, out  # the checksums match: a plain verify cannot see it
    code, out = _cli("verify", run, "--reference", "--sample", "2")
    assert code == 1, out
    record = reference_verification.read_record(store.open_store(str(run)))
    assert not record.ok and len(record.documents) == 2
    assert all(f" hook {TAMPERED}: relative error " in f for f in record.failures)
    first = record.failures[0]
    assert first.startswith(record.documents[0].what + f" (partition "
                            f"{record.documents[0].partition}), hook {TAMPERED}: relative "
                            f"error ")
    assert "FAILED: 2 (document, hook) pair(s) out of tolerance:" in out and first in out
    assert 0.009 < record.hooks[TAMPERED] < 0.011
    assert max(v for h, v in record.hooks.items() if h != TAMPERED) < 1e-4
    assert record.summary() == f"reference: FAILED: {first}"


def test_a_lost_object_is_a_failure_of_the_documents_it_held(released, tmp_path):
    """An activation object deleted after its commit would read as zeros: the reference
    check names it for each document drawn there, with what finishes the run, instead of
    comparing zeros."""
    _, clean = released
    run = shutil.copytree(clean, tmp_path / "run")
    shutil.rmtree(os.path.join(run, layout.activation_array_key(TAMPERED), "c"))
    code, out = _cli("verify", run, "--reference", "--sample", "2")
    assert code == 1, out
    record = reference_verification.read_record(store.open_store(str(run)))
    assert not record.ok and len(record.failures) == 2, record.failures
    for failure in record.failures:
        assert "have lost activations that a read would return as zeros" in failure
        assert f"array {TAMPERED}" in failure and f"`actx verify {run} --repair`" in failure


def test_json_and_only(released):
    _, run = released
    code, out = _cli("verify", run, "--reference", "--json", "--only", "1", "--sample", "1")
    assert code == 0, out
    data = json.loads(out)
    assert data["ok"] and [d["partition"] for d in data["documents"]] == ["p-00001"]


def test_without_torch_it_says_so_in_one_line(released, monkeypatch, capsys):
    _, run = released
    monkeypatch.setitem(sys.modules, "torch", None)
    code, _ = _cli("verify", run, "--reference")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "pip install 'actx-lm[torch]'" in err


def test_the_docs_page_blocks_run(released, tmp_path):
    """docs/checkpoints.md: its config fragment loads as a submit config, and its commands
    run as written on a run (the page's runs/demo is this module's)."""
    import re

    from actx.deploy import config as deploy_config
    from actx.schemas import config as config_lib
    from tests.test_readme import _merged

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "checkpoints.md").read_text()
    assert not re.search(r"^```(?!yaml|sh|$)", text, re.M)  # no block of another kind
    [fragment] = re.findall(r"^```yaml\n(.*?)^```", text, re.S | re.M)
    path = tmp_path / "fragment.yaml"
    path.write_text(yaml.safe_dump(_merged(config_lib.load_file(deploy_config.DEMO_CONFIG),
                                           yaml.safe_load(fragment))))
    tokenizer = deploy_config.load_submit_config(str(path)).spec.tokenizer
    assert tokenizer.prepend_bos is True and tokenizer.chat_template == "default"
    [shell] = re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M)
    commands = [line.split("#")[0].split() for line in shell.splitlines() if line.strip()]
    assert len(commands) == 2
    for argv in commands:
        assert argv[:3] == ["actx", "verify", "runs/demo"]
        code, out = _cli(*argv[1:2], released[1], *argv[3:])
        assert code == 0, out


def _alter(run: str, hook: str, factor: float) -> None:
    """Scales every stored value of `hook` and rewrites each partition's checksums to
    match, as a faulty (or hostile) writer would."""
    s, loc = store.open_store(run), uri.parse(run)
    arr = ts_context.open_array(layout.array_spec(loc, layout.activation_array_key(hook)))
    for pid in sorted(commit.committed_partitions(s)):
        key = layout.commit_key(pid)
        marker = s.read_json(key)
        rows = range(marker["row_start"], marker["row_start"] + marker["row_count"],
                     marker["block_rows"])
        sums = []
        for lo in rows:
            hi = min(lo + marker["block_rows"], marker["row_start"] + marker["row_count"])
            block = arr[lo:hi].read().result() * np.float32(factor)
            arr[lo:hi].write(block).result()
            sums.append(commit.array_checksum(arr[lo:hi].read().result()))
        marker["checksums"][hook] = sums
        with open(os.path.join(run, key), "w") as f:
            json.dump(marker, f)


def _all_documents(run: str) -> list[tuple[str, int]]:
    """(doc_id, doc_index) of every document starting in a committed partition, read from
    the docs/ tables directly."""
    s = store.open_store(run)
    found = []
    for p in commit.committed_partitions(s):
        for line in (s.read(layout.docs_key(p)) or b"").decode().splitlines():
            if line.strip():
                doc = json.loads(line)
                found.append((str(doc["doc_id"]), int(doc["doc_index"])))
    return found


def test_sample_k_is_k_distinct_documents_drawn_over_documents(released):
    """`--sample K` recomputes exactly K distinct documents (all, if fewer), reproducibly by
    seed, never "no committed document" on a run that has them (issue 66: it drew
    partitions, then the documents starting in them, so a partition holding only the
    middle of a long document gave none)."""
    from actx.deploy import verify_reference
    from actx.reader import run as reader_run
    from actx.schemas import run_dir

    _, path = released
    everything = _all_documents(path)
    handle = run_dir.open_run(path)
    run = reader_run.Run(handle.store, handle.spec, handle.manifest)
    # Some partition starts no document: the case that said "no committed document".
    assert any(p.docs == 0 for p in handle.manifest.partitions)
    total = len(everything)
    seen = set()
    for seed in range(12):
        for k in (1, 2, 3, total, total + 5):
            units = verify_reference.sample(run, k, seed, None)
            names = [u.what for u in units]
            assert len(names) == len(set(names)) == min(k, total), (seed, k, names)
            assert names == [u.what for u in verify_reference.sample(run, k, seed, None)]
            if k == 1:
                seen.add(names[0])
    # Drawn over documents: a dozen single draws reach documents of several partitions.
    assert len(seen) > 3, seen
    whole = {u.what for u in verify_reference.sample(run, total, 0, None)}
    assert whole == {f"document {d} (doc_index {i})" for d, i in everything}
    code, out = _cli("verify", path, "--reference", "--sample", "1", "--seed", "3", "--json")
    assert code == 0, out
    assert len(json.loads(out)["documents"]) == 1


def test_documents_too_long_for_the_reference_are_passed_over_and_said(released,
                                                                       monkeypatch, capsys):
    """A document over MAX_TOKENS (the reference computes a document whole, with a
    [tokens, tokens] mask) is not recomputed: verify says how many the draw met and how long
    the longest was, where it passed them over in silence (issue 66's audit: a 9,000-token
    document past max_context was never in the sample, and nothing said so); when every
    document is over, it says that instead of "no committed document"."""
    from actx.deploy import verify_reference
    from actx.reader import run as reader_run
    from actx.schemas import run_dir

    _, path = released
    handle = run_dir.open_run(path)
    run = reader_run.Run(handle.store, handle.spec, handle.manifest)
    total = len(_all_documents(path))
    lengths = sorted(u.rows.size for u in verify_reference.sample(run, total, 0, None))
    limit = lengths[-3]  # the two longest are over it
    monkeypatch.setattr(verify_reference, "MAX_TOKENS", limit)
    code, out = _cli("verify", path, "--reference", "--sample", str(total))
    assert code == 0, out
    assert (f"verify --reference: 2 document(s) of the draw are longer than {limit:,} tokens "
            f"(the longest {lengths[-1]:,}) and were passed over") in out, out
    recomputed = re.findall(r"recomputed document .*?: (\d+) tokens", out)
    assert len(recomputed) == total - 2 and max(map(int, recomputed)) <= limit, out
    monkeypatch.setattr(verify_reference, "MAX_TOKENS", lengths[0] - 1)
    code, _ = _cli("verify", path, "--reference")
    err = capsys.readouterr().err
    assert code == 2 and (f"every committed document drawn is longer than {lengths[0] - 1:,} "
                          f"tokens (the longest {lengths[-1]:,})") in err, err

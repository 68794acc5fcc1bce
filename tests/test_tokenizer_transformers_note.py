"""Where transformers' AutoTokenizer encodes otherwise than a tokenizer's tokenizer.json
(transformers 5 rebuilds a class named in tokenizer_config.json from its own code; here an
`add_prefix_space: true` that the file's pre-tokenizer does not carry), prepare says so in
its output with an example and the load that gives actx's ids, and stores
tokenizer.json's ids as before (pipeline.hf_tokenizer_check, docs/checkpoints.md). The
reference is transformers itself, asked in the test."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import pytest

from actx.pipeline import hf_tokenizer_check
from actx.pipeline import main as prepare_main
from actx.pipeline import tokenize
from actx.schemas import runspec
from tests.test_bos_rule import stored_documents

transformers = pytest.importorskip("transformers")


@pytest.fixture
def prefix_space_tokenizer(qwen_tokenizer_dir, tmp_path) -> str:
    """The Qwen tokenizer with tokenizer_config.json's add_prefix_space: true."""
    path = tmp_path / "qwen-prefix-space"
    shutil.copytree(qwen_tokenizer_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config,
                                                            "add_prefix_space": True}))
    return str(path)


def test_a_tokenizer_transformers_encodes_otherwise_is_noted_with_an_example(
        prefix_space_tokenizer, qwen_tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ACTX_CACHE", str(tmp_path / "cache"))
    hf = transformers.AutoTokenizer.from_pretrained(prefix_space_tokenizer)
    own = tokenize.load_tokenizer(prefix_space_tokenizer).tokenizer
    text = hf_tokenizer_check.PROBES[0]
    theirs = hf(text, add_special_tokens=False)["input_ids"]
    ours = own.encode(text, add_special_tokens=False).ids
    assert theirs != ours  # what the note is about, as transformers itself gives it
    note = hf_tokenizer_check.note(own, prefix_space_tokenizer)
    assert note.startswith(f"transformers {transformers.__version__}'s AutoTokenizer "
                           f"({type(hf).__name__}) encodes {text!r} as {theirs}, and "
                           f"tokenizer.json as {ours}: "), note
    # The load it names, followed as printed, gives actx's ids.
    [load] = re.findall(r"PreTrainedTokenizerFast\(tokenizer_file='[^']+'\)", note)
    as_named = eval(load, {"PreTrainedTokenizerFast": transformers.PreTrainedTokenizerFast})
    for probe in hf_tokenizer_check.PROBES:
        assert (as_named(probe, add_special_tokens=False)["input_ids"]
                == own.encode(probe, add_special_tokens=False).ids)
    # The tokenizer as saved, which transformers encodes as its file: nothing to say.
    plain = tokenize.load_tokenizer(qwen_tokenizer_dir).tokenizer
    assert hf_tokenizer_check.note(plain, qwen_tokenizer_dir) is None
    # Found once per tokenizer and transformers version: asked again without transformers
    # to load it, the answer kept says the same.
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert hf_tokenizer_check.note(own, prefix_space_tokenizer) == note
    assert hf_tokenizer_check.note(plain, qwen_tokenizer_dir) is None
    kept = os.listdir(tmp_path / "cache" / "tokenizer-checks")
    assert len(kept) == 2 and all(k.endswith(".json") for k in kept)


def test_prepare_says_the_note_and_stores_tokenizer_json_ids(prefix_space_tokenizer,
                                                             tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ACTX_CACHE", str(tmp_path / "cache"))
    texts = ["Hello world", "The cat sat."]
    (tmp_path / "in.jsonl").write_text("".join(
        json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    spec = runspec.RunSpec.from_dict({
        "name": "note", "model": {"path": ""}, "tokenizer": {"path": prefix_space_tokenizer},
        "sources": [{"kind": "text", "paths": [str(tmp_path / "in.jsonl")]}],
        "packing": {"mode": "segmented", "seq_len": 16},
        "layout": {"rows_per_shard": 2, "partition_rows": 4}})
    run = str(tmp_path / "run")
    with caplog.at_level("WARNING", logger="actx.prepare"):
        prepare_main.run_prepare(spec, run)
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"prepare: transformers {transformers.__version__}'s "
                            f"AutoTokenizer") for m in said), said
    # Said, not recorded: run.json's notes are the tokenizer rules' (their contract).
    notes = json.loads((tmp_path / "run" / "run.json").read_text())[
        "tokenizer_identity"]["notes"]
    assert not any("AutoTokenizer" in n for n in notes), notes
    file = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(prefix_space_tokenizer, "tokenizer.json"))
    assert stored_documents(run) == {f"d{i}": file(t)["input_ids"]
                                     for i, t in enumerate(texts)}

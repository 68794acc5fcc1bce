"""BOS by the tokenizer's own rule: prepare's tokens equal HF transformers'
`tokenizer(text)` for the tokenizers of each supported family as transformers saves them
(tests/tokenizer_families.py), unless the spec says otherwise; what was applied is in
run.json; runs made before `prepend_bos` keep their fingerprint and their tokens."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from actx.pipeline import main as prepare_main, prepare_refusals
from actx.pipeline import preflight as pipeline_preflight
from actx.pipeline import tokenize
from actx.schemas import config as config_lib
from actx.schemas import layout, runspec, store, ts_context, uri
from tests import tokenizer_families as families
from tests.test_old_runs import OLD, old_inputs  # noqa: F401 (a fixture)

TEXTS = ["The 3th document of a small corpus.", "grids of colours, rows and columns",
         " leading space and digits 0123456789", "Example 5 input and output." * 6]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {f: families.save_family(root / f, f) for f in families.FAMILIES}


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("texts") / "texts.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n"
                            for i, t in enumerate(TEXTS)))
    return str(path)


def _spec(tokenizer: str, texts: str, **tokenizer_settings) -> runspec.RunSpec:
    return runspec.RunSpec.from_dict({
        "name": "bos", "model": {"path": ""},
        "tokenizer": {"path": tokenizer, **tokenizer_settings},
        "sources": [{"kind": "text", "paths": [texts]}],
        "packing": {"mode": "segmented", "seq_len": 16},
        "layout": {"rows_per_shard": 2, "partition_rows": 4}})


def stored_documents(run: str) -> dict[str, list[int]]:
    """doc_id -> the document's stored token ids, in order (from the token store)."""
    loc, s = uri.parse(run), store.open_store(run)
    arrays = {name: ts_context.open_array(layout.array_spec(
        loc, layout.token_array_key(name))).read().result()
        for name in ("input_ids", "doc_index")}
    out = {}
    for key in s.list(layout.DOCS_PREFIX):
        for line in s.read(key).decode().splitlines():
            doc = json.loads(line)
            out[doc["doc_id"]] = arrays["input_ids"][arrays["doc_index"] == doc["doc_index"]
                                                     ].tolist()
    return out


def _prepare(spec: runspec.RunSpec, run) -> tuple[dict[str, list[int]], dict]:
    prepare_main.run_prepare(spec, str(run))
    return stored_documents(str(run)), json.load(open(os.path.join(run, "run.json")))


@pytest.mark.parametrize("family", families.FAMILIES)
def test_prepare_gives_what_hf_tokenizer_gives(family, tokenizers, texts, tmp_path):
    hf = families.hf_tokenizer(tokenizers[family])
    docs, recorded = _prepare(_spec(tokenizers[family], texts), tmp_path / "run")
    for i, text in enumerate(TEXTS):
        assert docs[f"d{i}"] == hf(text)["input_ids"], (family, text)
    opens_with_bos = family in ("llama3", "llama2", "gemma")
    bare = hf(TEXTS[0], add_special_tokens=False)["input_ids"]
    assert (hf(TEXTS[0])["input_ids"] != bare) == opens_with_bos  # the families differ
    record = recorded["tokenizer_identity"]
    assert record["bos_rule"] == "tokenizer"
    assert record["prepended"] == ([hf.bos_token_id] if opens_with_bos else [])
    assert "prepend_bos" not in recorded["tokenizer"] and "add_bos" not in recorded["tokenizer"]


@pytest.mark.parametrize("family,prepend", [("gpt2", True), ("llama3", False),
                                            ("gemma", False), ("qwen2", False)])
def test_prepend_bos_overrides_the_rule_and_is_recorded(family, prepend, tokenizers, texts,
                                                        tmp_path):
    hf = families.hf_tokenizer(tokenizers[family])
    spec = _spec(tokenizers[family], texts, prepend_bos=prepend)
    assert spec.fingerprint != _spec(tokenizers[family], texts).fingerprint
    docs, recorded = _prepare(spec, tmp_path / "run")
    for i, text in enumerate(TEXTS):
        bare = hf(text, add_special_tokens=False)["input_ids"]
        assert docs[f"d{i}"] == ([hf.bos_token_id] if prepend else []) + bare
    assert recorded["tokenizer"]["prepend_bos"] is prepend
    assert recorded["tokenizer_identity"]["bos_rule"] == "prepend_bos"


def test_prepend_bos_of_a_tokenizer_without_one_is_refused_before_work(tokenizers, texts,
                                                                       tmp_path):
    spec = _spec(tokenizers["qwen2"], texts, prepend_bos=True)
    problems, _, _ = pipeline_preflight.check_inputs(spec)  # what `actx submit` checks first
    assert len(problems) == 1 and "spec.tokenizer.prepend_bos: true, but the tokenizer at " \
        f"{tokenizers['qwen2']} has no BOS token" in problems[0]
    with pytest.raises(tokenize.TokenizerError, match="has no BOS token"):
        prepare_main.run_prepare(spec, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_add_bos_keeps_the_rule_of_earlier_runs(tokenizers, texts, tmp_path):
    """add_bos (the old spelling, written by every earlier run.json): BOS on every document
    when the tokenizer names one, whatever its post-processor does; hashed as before."""
    hf = families.hf_tokenizer(tokenizers["gpt2"])
    spec = _spec(tokenizers["gpt2"], texts, add_bos=True)
    docs, recorded = _prepare(spec, tmp_path / "run")
    for i, text in enumerate(TEXTS):
        assert docs[f"d{i}"] == [hf.bos_token_id] + hf(text)["input_ids"]
    assert recorded["tokenizer"]["add_bos"] is True
    assert recorded["tokenizer_identity"]["bos_rule"] == "add_bos"
    assert runspec.RunSpec.from_dict(recorded).fingerprint == recorded["fingerprint"]
    # The same spec without add_bos is another run (other tokens): refused, saying how to
    # go on with this one.
    with pytest.raises(prepare_refusals.PrepareError) as e:
        prepare_main.run_prepare(_spec(tokenizers["gpt2"], texts), str(tmp_path / "run"))
    assert str(e.value).endswith(
        "choose a new run directory; or go on with it: it was prepared before "
        "spec.tokenizer.prepend_bos, with add_bos: true (docs/checkpoints.md): add that to "
        f"spec.tokenizer, or `actx rerun {tmp_path / 'run'}`")
    with pytest.raises(config_lib.ConfigError, match=r"tokenizer: prepend_bos \(false\) and "
                                                     r"add_bos \(true, its old spelling\) "
                                                     r"disagree; give prepend_bos alone"):
        _spec(tokenizers["gpt2"], texts, add_bos=True, prepend_bos=False)


def test_the_command_lines_bos_flags(tokenizers, texts):
    args = prepare_main._parser().parse_args(["--out", "x", "--tokenizer", tokenizers["gpt2"],
                                              "--text", texts])
    assert prepare_main.spec_from_args(args).tokenizer.bos_choice is None
    for flag, choice in (("--no-bos", False), ("--prepend-bos", True)):
        args = prepare_main._parser().parse_args(
            ["--out", "x", "--tokenizer", tokenizers["gpt2"], "--text", texts, flag])
        assert prepare_main.spec_from_args(args).tokenizer.prepend_bos is choice


def test_a_contradicting_add_bos_token_follows_transformers_and_is_noted(tokenizers, texts,
                                                                         tmp_path):
    """tokenizer_config.json says add_bos_token: false while tokenizer.json's post-processor
    adds BOS (a hand-edited config): transformers 5 reads tokenizer.json; so does actx, and
    run.json says what it found."""
    tok = shutil.copytree(tokenizers["llama2"], tmp_path / "tok")
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    hf = families.hf_tokenizer(tok)
    docs, recorded = _prepare(_spec(str(tok), texts), tmp_path / "run")
    assert docs["d0"] == hf(TEXTS[0])["input_ids"]
    [note] = recorded["tokenizer_identity"]["notes"]
    assert "add_bos_token: false, but the post-processor of tokenizer.json adds BOS" in note


def test_a_run_made_before_prepend_bos_keeps_its_fingerprint_and_tokens(old_inputs, tmp_path):
    """The 0.1.0 run (tests/old_runs): its tokenizer names <s> but its post-processor adds
    none. Its run.json says add_bos: true, so preparing its spec again gives its
    fingerprint and, byte for byte, its token store: BOS on every document. The same spec
    written today without add_bos follows the tokenizer (no BOS): another run."""
    old = store.open_store(str(OLD / "run"))
    recorded = json.loads((OLD / "run" / "run.json").read_text())
    spec = runspec.read_run_spec(old)
    assert spec.fingerprint == recorded["fingerprint"] == "f0b4a2a9fa02f967"
    run = tmp_path / "run"
    prepare_main.run_prepare(spec, str(run))
    assert json.loads((run / "run.json").read_text())["fingerprint"] == recorded["fingerprint"]
    for name in ("input_ids", "segment_ids", "positions", "doc_index", "context_start"):
        mine, theirs = (ts_context.open_array(layout.array_spec(
            uri.parse(str(where)), layout.token_array_key(name))).read().result()
            for where in (run, OLD / "run"))
        np.testing.assert_array_equal(mine, theirs, err_msg=name)
    hf = families.hf_tokenizer(OLD / "tokenizer")
    assert all(ids[0] == hf.bos_token_id for ids in stored_documents(str(run)).values())

    today = runspec.RunSpec.from_dict({**spec.to_dict(), "tokenizer": {
        "path": spec.tokenizer.path}})
    assert today.fingerprint != spec.fingerprint
    assert hf("a text")["input_ids"] == hf("a text", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("edit", ["digits_split_one_by_one", "sentencepiece_normalizer"])
def test_a_tokenizer_transformers_5_rebuilds_is_encoded_as_its_tokenizer_json(
        edit, tokenizers, texts, tmp_path):
    """transformers 5 builds GPT2Tokenizer / LlamaTokenizer from their own code, keeping
    only tokenizer.json's vocabulary, merges and post-processor: where the file's
    pre-tokenizer or normalizer differs (digits split one by one, as SmolLM2's file does;
    Llama 2's SentencePiece-style `Prepend("▁")`), AutoTokenizer's ids differ from the
    file's. actx encodes with the file, as docs/checkpoints.md says, and equals
    `PreTrainedTokenizerFast(tokenizer_file=...)`, the comparison it advises."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    family = "gpt2" if edit == "digits_split_one_by_one" else "llama2"
    path = tmp_path / "tok"
    shutil.copytree(tokenizers[family], path)
    data = json.loads((path / "tokenizer.json").read_text())
    if family == "gpt2":
        data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, data["pre_tokenizer"]]}
    else:
        data["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
        data["pre_tokenizer"] = None
    (path / "tokenizer.json").write_text(json.dumps(data))
    docs, _ = _prepare(_spec(str(path), texts), tmp_path / "run")
    from_file = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    for i, text in enumerate(TEXTS):
        assert docs[f"d{i}"] == from_file(text)["input_ids"], text
    # The divergence docs/checkpoints.md describes (if transformers stops rebuilding these
    # classes, that page and this test change).
    rebuilt = AutoTokenizer.from_pretrained(str(path))
    assert any(rebuilt(t)["input_ids"] != from_file(t)["input_ids"] for t in TEXTS)


SPECIAL_TEXTS = {"qwen2": "a <|im_start|>user grids<|im_end|> and <|endoftext|> rows",
                 "llama3": "a <|start_header_id|>user<|end_header_id|> grids<|eot_id|> rows"}


def _with_config(tokenizer: str, out, **settings) -> str:
    """A copy of a tokenizer directory whose tokenizer_config.json has `settings` too."""
    shutil.copytree(tokenizer, out)
    config = json.load(open(os.path.join(out, "tokenizer_config.json")))
    config.update(settings)
    json.dump(config, open(os.path.join(out, "tokenizer_config.json"), "w"))
    return str(out)


def _one_text(tmp_path, text: str) -> str:
    path = tmp_path / "special.jsonl"
    path.write_text(json.dumps({"id": "s", "text": text}) + "\n")
    return str(path)


@pytest.mark.parametrize("family", list(SPECIAL_TEXTS))
def test_split_special_tokens_spells_them_out_as_transformers_does(family, tokenizers,
                                                                   tmp_path):
    """tokenizer_config.json's `split_special_tokens: true`: transformers tokenizes a
    special token's text in a document as text; so does prepare (BOS still by the rule)."""
    text = SPECIAL_TEXTS[family]
    split = _with_config(tokenizers[family], tmp_path / "tok", split_special_tokens=True)
    hf = families.hf_tokenizer(split)
    assert hf(text)["input_ids"] != families.hf_tokenizer(tokenizers[family])(text)["input_ids"]
    docs, _ = _prepare(_spec(split, _one_text(tmp_path, text)), tmp_path / "run")
    assert docs["s"] == hf(text)["input_ids"]


# tokenizer_config.json settings naming tokens its tokenizer.json lacks: whether
# transformers adds them (and its ids of a text with them differ from tokenizer.json's).
NAMED_ONLY_IN_CONFIG = {
    "extra_special_tokens": ({"extra_special_tokens": ["<tool>", "grids"]}, True),
    "added_tokens_decoder": ({"added_tokens_decoder": {"3": {
        "content": "<tool>", "special": True, "normalized": False, "lstrip": False,
        "rstrip": False, "single_word": False}}}, True),
    "pad_token": ({"pad_token": "<tool>"}, True),
    "additional_special_tokens": ({"additional_special_tokens": ["<tool>", "grids"]}, False),
}


@pytest.mark.parametrize("name", list(NAMED_ONLY_IN_CONFIG))
def test_tokens_only_tokenizer_config_names_are_refused_with_a_command_that_mends_it(
        name, tokenizers, tmp_path):
    """Where transformers adds tokens that only tokenizer_config.json names, prepare says
    so before any work, with a command that saves the tokenizer as transformers loads it;
    run as printed, prepare's ids equal transformers'. Where it adds none, nothing is
    refused. The reference: AutoTokenizer on the directory."""
    import shlex
    import subprocess
    import sys

    settings, added = NAMED_ONLY_IN_CONFIG[name]
    text = "a <tool> grids and rows"
    tok = _with_config(tokenizers["qwen2"], tmp_path / "tok", **settings)
    texts = _one_text(tmp_path, text)
    own = tokenize._load_tokenizer(tokenizers["qwen2"]).tokenizer.encode(text).ids
    assert (families.hf_tokenizer(tok)(text)["input_ids"] != own) == added
    if not added:
        docs, _ = _prepare(_spec(tok, texts), tmp_path / "run")
        assert docs["s"] == own
        return
    with pytest.raises(tokenize.TokenizerError) as refused:
        prepare_main.run_prepare(_spec(tok, texts), str(tmp_path / "run"))
    said = str(refused.value)
    assert f"{tok}/tokenizer_config.json names tokens that tokenizer.json does not hold " \
           f"('<tool>'" in said, said
    assert not (tmp_path / "run").exists()
    command = shlex.split(said.split("then run again: ", 1)[1])
    assert command[0] == "python"
    done = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    docs, _ = _prepare(_spec(tok, texts), tmp_path / "run")
    assert docs["s"] == families.hf_tokenizer(tok)(text)["input_ids"]


@pytest.mark.parametrize("family,separator,add_eos,doubled", [
    ("qwen2", "eos", True, True), ("qwen2", "eos", False, False),
    ("qwen2", "none", True, False), ("llama3", "bos", False, True),
    ("llama3", "eos", False, False)])
def test_a_concat_separator_the_rules_already_put_is_noted(family, separator, add_eos,
                                                           doubled, tokenizers, texts,
                                                           tmp_path):
    """concat's separator is put between documents besides what the run's rules put
    around each: where that is the same id, every boundary holds it twice, as asked; the
    record says so. The reference: HF's ids of each document, the rules' EOS, the
    separator."""
    spec = runspec.RunSpec.from_dict({
        **_spec(tokenizers[family], texts, add_eos=add_eos).to_dict(),
        "packing": {"mode": "concat", "seq_len": 256, "separator": separator}})
    prepare_main.run_prepare(spec, str(tmp_path / "run"))
    hf = families.hf_tokenizer(tokenizers[family])
    sep = {"eos": [hf.eos_token_id], "bos": [hf.bos_token_id], "none": []}[separator]
    stream = []
    for i, text in enumerate(TEXTS):
        stream += (sep if i else []) + hf(text)["input_ids"] + ([hf.eos_token_id] if add_eos
                                                                 else [])
    ids = ts_context.open_array(layout.array_spec(uri.parse(str(tmp_path / "run")),
                                                  layout.token_array_key("input_ids")))
    assert ids.read().result()[0][:len(stream)].tolist() == stream
    notes = json.load(open(tmp_path / "run" / "run.json"))["tokenizer_identity"]["notes"]
    said = [n for n in notes if n.startswith("packing.separator")]
    assert bool(said) == doubled, notes
    if doubled:
        assert "holds it twice; separator: none puts it once" in said[0]

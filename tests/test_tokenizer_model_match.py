"""The tokenizer is the model's: a tokenizer of another model is refused before any work
(`actx submit`, `actx prepare`), workers check the run's recorded tokenizer against the
checkpoint they load, a deliberate mismatch takes `spec.tokenizer.allow_model_mismatch`
and is recorded in run.json, and runs of spec_version 2 stay readable.

The other tokenizers are real `tokenizers` files: one trained here (282 ids, as in the
report that opened issue 28) and the Qwen2.5 tokenizer with one part edited.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil

import pytest
import yaml

from actx.deploy import cli
from actx.schemas import run_dir, runspec, store
from actx.schemas import tokenizer_identity as tid
from tests import hf_models

QWEN_ROWS = 151936  # Qwen2.5's embedding rows (its tokenizer has 151,665 ids)
ENDOFTEXT, IM_END = 151643, 151645


@pytest.fixture(scope="module")
def small_tokenizer_dir(tmp_path_factory) -> str:
    """A byte-level BPE of 282 ids trained on a few sentences: another model's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=282, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"document {i} of the small corpus " * 3 for i in range(50)],
                            trainer)
    out = tmp_path_factory.mktemp("small_tok")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                           "eos_token": "</s>"}))
    assert tok.get_vocab_size() == 282
    return str(out)


def _edited_qwen(qwen_dir: str, out, edit) -> str:
    """A copy of the Qwen tokenizer whose tokenizer.json `edit` changed."""
    os.makedirs(out, exist_ok=True)
    data = json.load(open(os.path.join(qwen_dir, "tokenizer.json")))
    edit(data)
    json.dump(data, open(os.path.join(out, "tokenizer.json"), "w"))
    shutil.copy(os.path.join(qwen_dir, "tokenizer_config.json"), out)
    return str(out)


def _model(path, with_tokenizer: str | None = None, generation: dict | None = None,
           **config) -> str:
    """A Qwen2.5-shaped checkpoint directory (narrow: 8 wide, zero float16 weights of the
    shapes its config.json gives), Qwen2.5 base's special ids, and optionally its
    tokenizer files and a generation_config.json."""
    import numpy as np
    from safetensors.numpy import save_file

    from actx.workers.model import checkpoint_check

    cfg = hf_models.tiny_config("qwen2", architectures=["Qwen2ForCausalLM"],
                                vocab_size=QWEN_ROWS, num_hidden_layers=2, hidden_size=8,
                                num_attention_heads=2, num_key_value_heads=1,
                                intermediate_size=16, bos_token_id=ENDOFTEXT,
                                eos_token_id=ENDOFTEXT, **config)
    os.makedirs(path, exist_ok=True)
    cfg.to_json_file(os.path.join(path, "config.json"))
    shapes = checkpoint_check.needed_tensors(_model_config(str(path)))
    save_file({name: np.zeros(shape, np.float16) for name, shape in shapes.items()},
              os.path.join(path, "model.safetensors"))
    if with_tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(with_tokenizer, name), path)
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return str(path)


def _texts(tmp_path) -> str:
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": f"document {i} " * (5 + i)})
                            + "\n" for i in range(12)))
    return str(path)


def _spec(tmp_path, model: str, tokenizer: str, **tokenizer_settings) -> dict:
    return {"name": "tm", "model": {"path": model},
            "tokenizer": {"path": tokenizer, **tokenizer_settings},
            "sources": [{"kind": "text", "paths": [_texts(tmp_path)]}],
            "packing": {"seq_len": 16}, "layout": {"rows_per_shard": 2, "partition_rows": 4},
            "capture": {"hooks": "layers.0.resid_post"}}


def _submit(tmp_path, spec: dict, *flags: str) -> int:
    path = tmp_path / f"c{len(list(tmp_path.glob('c*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump({"run": str(tmp_path / "run"), "spec": spec,
                                    "target": {"kind": "local", "hosts": 1, "batch_size": 2}}))
    return cli.main(["submit", str(path), *flags], out=io.StringIO())


def _prepare(tmp_path, spec: dict, run: str) -> tuple[int, str]:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["prepare", "--spec", str(path), "--out", run, "--runner=FnApiRunner"])
    return code, out.getvalue()


def test_another_models_small_tokenizer_is_refused_before_any_work(
        tmp_path, small_tokenizer_dir, capsys):
    """The case of the report: 282 ids against 151,936 rows, exit 0 and verify OK before."""
    model = _model(tmp_path / "m")
    assert _submit(tmp_path, _spec(tmp_path, model, small_tokenizer_dir)) == 2
    err = capsys.readouterr().err
    assert "2 problems, nothing was started" in err
    assert ("its vocabulary (282 ids) is far smaller than the model's embedding (151,936 "
            "rows" in err and "0.2% of it" in err)
    assert (f"not the model's tokenizer: {model}'s config.json bos_token_id=151643 is beyond "
            f"its 282 ids; config.json eos_token_id=151643 is beyond its 282 ids" in err)
    assert "spec.tokenizer.allow_model_mismatch: true" in err
    assert not (tmp_path / "run").exists()
    # `actx prepare` alone refuses it the same way, writing nothing.
    code, out = _prepare(tmp_path, _spec(tmp_path, model, small_tokenizer_dir),
                         str(tmp_path / "run"))
    assert code == 2 and "far smaller than the model's embedding" in out
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_other_than_the_checkpoints_own_is_refused_naming_both(
        tmp_path, qwen_tokenizer_dir, capsys):
    def edit(data):
        data["normalizer"] = {"type": "NFKC"}
        data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] != IM_END]

    other = _edited_qwen(qwen_tokenizer_dir, tmp_path / "other", edit)
    model = _model(tmp_path / "m", with_tokenizer=qwen_tokenizer_dir)
    assert _submit(tmp_path, _spec(tmp_path, model, other)) == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "is not the tokenizer of the model" in x)
    assert f"{other} is not the tokenizer of the model {model}" in line
    assert "vocabulary: 151,664 vs 151,665 ids" in line
    assert "special tokens: only in the model's: '<|im_end|>'=151645" in line
    assert "normalizer: NFKC / " in line and " vs NFC / " in line
    assert not (tmp_path / "run").exists()


def test_special_ids_of_the_models_config_must_be_special_tokens(tmp_path, qwen_tokenizer_dir,
                                                                 capsys):
    """An id the model's config names as eos that is an ordinary token of the tokenizer
    (a vocabulary of the same size, another model's special ids)."""
    model = _model(tmp_path / "m", generation={"eos_token_id": [IM_END, 13]})
    assert _submit(tmp_path, _spec(tmp_path, model, qwen_tokenizer_dir)) == 2
    err = capsys.readouterr().err
    assert "generation_config.json eos_token_id=13 is '.', not a special token" in err
    assert "151645" not in err  # <|im_end|> is one of its special tokens


def test_an_instruct_tokenizer_beside_a_base_models_config_is_accepted(
        tmp_path, qwen_tokenizer_dir, capsys):
    """Qwen2.5 base names <|endoftext|> as eos, the instruct tokenizer <|im_end|>: both are
    special tokens of one vocabulary, so nothing is wrong."""
    instruct = _edited_qwen(qwen_tokenizer_dir, tmp_path / "instruct", lambda d: None)
    config = json.load(open(os.path.join(instruct, "tokenizer_config.json")))
    json.dump({**config, "eos_token": "<|im_end|>"},
              open(os.path.join(instruct, "tokenizer_config.json"), "w"))
    model = _model(tmp_path / "m", with_tokenizer=qwen_tokenizer_dir,
                   generation={"bos_token_id": ENDOFTEXT, "eos_token_id": ENDOFTEXT,
                               "pad_token_id": ENDOFTEXT})
    code, out = _prepare(tmp_path, _spec(tmp_path, model, instruct), str(tmp_path / "run"))
    assert code == 0, out


def test_a_deliberate_mismatch_is_allowed_and_recorded(tmp_path, small_tokenizer_dir):
    model = _model(tmp_path / "m")
    run = str(tmp_path / "run")
    spec = _spec(tmp_path, model, small_tokenizer_dir, allow_model_mismatch=True)
    code, out = _prepare(tmp_path, spec, run)
    assert code == 0, out
    recorded = store.open_store(run).read_json("run.json")
    assert recorded["spec_version"] == 3
    assert recorded["tokenizer"]["allow_model_mismatch"] is True
    expected = tid.read_tokenizer(small_tokenizer_dir).identity()
    assert recorded["tokenizer_identity"]["fingerprint"] == expected.fingerprint
    assert recorded["tokenizer_identity"]["vocab_size"] == 282
    # The permission is part of what the run is, not of its tokens.
    strict = runspec.RunSpec.from_dict(_spec(tmp_path, model, small_tokenizer_dir))
    opened = run_dir.open_run(run)
    assert opened.spec.fingerprint != strict.fingerprint
    assert opened.spec.tokens_fingerprint == strict.tokens_fingerprint


def _prepared_run(tmp_path, qwen_tokenizer_dir, model: str) -> str:
    run = str(tmp_path / "run")
    code, out = _prepare(tmp_path, _spec(tmp_path, model, qwen_tokenizer_dir), run)
    assert code == 0, out
    return run


def _model_config(model: str):
    from actx.workers.model import families

    return families.config_from_hf(json.load(open(os.path.join(model,
                                                                        "config.json"))))


def test_workers_check_the_recorded_tokenizer_against_the_checkpoint(tmp_path,
                                                                     qwen_tokenizer_dir):
    """The checkpoint at the run's model path changed after the prepare: its own tokenizer
    is not the one the tokens were made with, or its config names other special ids."""
    from actx.workers.loop import admission

    model = _model(tmp_path / "m", with_tokenizer=qwen_tokenizer_dir)
    run = _prepared_run(tmp_path, qwen_tokenizer_dir, model)
    opened = run_dir.open_run(run)
    recorded = opened.spec.tokenizer_identity
    assert recorded == tid.read_tokenizer(qwen_tokenizer_dir).identity()
    admission.check_vocabulary(opened.spec, opened.manifest, _model_config(model))  # passes

    _edited_qwen(qwen_tokenizer_dir, model, lambda d: d.update(normalizer={"type": "NFKC"}))
    with pytest.raises(admission.RunMismatch) as e:
        admission.check_vocabulary(opened.spec, opened.manifest, _model_config(model))
    theirs = tid.read_tokenizer(model).identity()
    assert (f"the run's tokens were made with the tokenizer at {qwen_tokenizer_dir} "
            f"(fingerprint {recorded.fingerprint}, 151,665 ids), but the model {model} has "
            f"its own tokenizer.json (fingerprint {theirs.fingerprint}, 151,665 ids; "
            f"normalizer differ)") in str(e.value)

    _edited_qwen(qwen_tokenizer_dir, model, lambda d: None)  # its tokenizer back
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"pad_token_id": 220}))
    with pytest.raises(admission.RunMismatch, match="generation_config.json pad_token_id=220 "
                                                    "is not a special token of it"):
        admission.check_vocabulary(opened.spec, opened.manifest, _model_config(model))
    allowed = runspec.RunSpec.from_dict({**opened.spec.to_dict(), "tokenizer": {
        **opened.spec.to_dict()["tokenizer"], "allow_model_mismatch": True}})
    admission.check_vocabulary(allowed, opened.manifest, _model_config(model))


def test_a_run_of_spec_version_2_stays_readable(tmp_path, qwen_tokenizer_dir):
    """run.json as actx wrote it before the tokenizer was recorded: it opens with the same
    fingerprint (the manifest and commit markers name it), and workers check it by the
    manifest's vocabulary and special ids."""
    from actx.workers.loop import admission

    model = _model(tmp_path / "m")
    run = _prepared_run(tmp_path, qwen_tokenizer_dir, model)
    path = os.path.join(run, "run.json")
    data = json.load(open(path))
    del data["tokenizer_identity"], data["tokenizer"]["allow_model_mismatch"]
    data["spec_version"] = 2
    json.dump(data, open(path, "w"))
    opened = run_dir.open_run(run)
    assert opened.spec.tokenizer_identity is None
    assert opened.spec.fingerprint == data["fingerprint"] == opened.manifest.fingerprint
    admission.check_vocabulary(opened.spec, opened.manifest, _model_config(model))
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": 13}))
    with pytest.raises(admission.RunMismatch, match="eos_token_id=13 is not a special token"):
        admission.check_vocabulary(opened.spec, opened.manifest, _model_config(model))


def _tokenizer_variant(base: str, out, edit) -> str:
    """A copy of the tokenizer directory `base` whose tokenizer.json `edit` changed."""
    shutil.copytree(base, out)
    data = json.load(open(os.path.join(out, "tokenizer.json")))
    edit(data)
    json.dump(data, open(os.path.join(out, "tokenizer.json"), "w"))
    return str(out)


def _ids(path: str, text: str) -> list[int]:
    """The reference: the ids HF transformers' `tokenizer(text)` gives."""
    from tests import tokenizer_families

    return tokenizer_families.hf_tokenizer(path)(text)["input_ids"]


def _eot(data: dict) -> dict:
    return next(t for t in data["added_tokens"] if t["content"] == "<|eot_id|>")


def _processors(data: dict) -> list:
    return data["post_processor"]["processors"]


# Edits of Llama 3's tokenizer.json that keep vocabulary, special tokens, normalizer and
# model (its fingerprint) but change the ids of a text: (edit, what the refusal names).
SAME_FINGERPRINT_OTHER_IDS = {
    "no BOS": (lambda d: d.update(post_processor=_processors(d)[0]),
               "post-processor: puts [] before a text and [] after it; the model's puts "
               "[400 '<|begin_of_text|>'] before a text and [] after it"),
    "EOS appended": (
        lambda d: _processors(d)[1]["single"].append({"SpecialToken": {
            "id": "<|eot_id|>", "type_id": 0}}) or _processors(d)[1]["special_tokens"].update(
            {"<|eot_id|>": {"id": "<|eot_id|>", "ids": [404], "tokens": ["<|eot_id|>"]}}),
        "[400 '<|begin_of_text|>'] before a text and [404 '<|eot_id|>'] after it"),
    "a token strips the blanks beside it": (
        lambda d: _eot(d).update(lstrip=True, rstrip=True),
        "added tokens' settings: '<|eot_id|>' lstrip true vs false, rstrip true vs false"),
}
# Edits that change no id: offsets only, or `normalized` without a normalizer.
SAME_IDS = {
    "offsets": lambda d: _processors(d)[0].update(trim_offsets=not _processors(d)[0].get(
        "trim_offsets", True)),
    "normalized, no normalizer": lambda d: _eot(d).update(normalized=not _eot(d)["normalized"]),
}
TEXT = "A <|eot_id|> B"


@pytest.fixture(scope="module")
def llama3_tokenizer(tmp_path_factory) -> str:
    from tests import tokenizer_families

    return tokenizer_families.save_family(tmp_path_factory.mktemp("llama3") / "tok", "llama3")


@pytest.mark.parametrize("name", list(SAME_FINGERPRINT_OTHER_IDS))
def test_a_tokenizer_that_makes_other_ids_is_refused_though_its_parts_are_the_models(
        tmp_path, llama3_tokenizer, name):
    """Vocabulary, special tokens, normalizer and merges (the fingerprint) are the model's,
    but the post-processor or an added token's settings are not: HF gives other ids for a
    text, so the pre-flight refuses it naming the difference, and a worker refuses a run
    recorded with it against the checkpoint's own tokenizer (and the other way round)."""
    edit, named = SAME_FINGERPRINT_OTHER_IDS[name]
    other = _tokenizer_variant(llama3_tokenizer, tmp_path / "other", edit)
    assert _ids(other, TEXT) != _ids(llama3_tokenizer, TEXT)  # it matters
    mine, model = tid.read_tokenizer(other), tid.read_tokenizer(llama3_tokenizer)
    assert mine.identity().fingerprint == model.identity().fingerprint
    [problem] = tid.match_problems(mine, other, llama3_tokenizer, None)
    assert f"{other} is not the tokenizer of the model {llama3_tokenizer}" in problem
    assert named in problem, problem
    assert tid.match_problems(mine, other, llama3_tokenizer, None, allowed=True) == []
    for recorded, checkpoint in ((mine, llama3_tokenizer), (model, other)):
        [problem] = tid.recorded_problems(recorded.identity(), "the run's", checkpoint)
        assert "post-processor or added tokens' settings differ" in problem, problem
    # A run recorded before the identity held its processing (0.3.0's first runs) is
    # checked by the fingerprint alone, as before.
    older = dataclasses.replace(mine.identity(), processing="")
    assert tid.recorded_problems(older, "the run's", llama3_tokenizer) == []


@pytest.mark.parametrize("name", list(SAME_IDS))
def test_a_tokenizer_that_differs_in_no_id_is_the_models(tmp_path, llama3_tokenizer, name):
    other = _tokenizer_variant(llama3_tokenizer, tmp_path / "other", SAME_IDS[name])
    assert _ids(other, TEXT) == _ids(llama3_tokenizer, TEXT)
    assert tid.match_problems(tid.read_tokenizer(other), other, llama3_tokenizer, None) == []
    assert tid.recorded_problems(tid.read_tokenizer(other).identity(), "the run's",
                                 llama3_tokenizer) == []


def test_what_the_identity_says_a_post_processor_puts_is_what_it_puts(tmp_path,
                                                                        qwen_tokenizer_dir):
    """`around` reads tokenizer.json as data; the reference is the `tokenizers` library
    itself, on each family's tokenizer, Qwen2.5's, and the processors BERT and RoBERTa
    checkpoints carry."""
    from tokenizers import Tokenizer, processors

    from actx.pipeline import tokenize
    from tests import tokenizer_families

    dirs = [tokenizer_families.save_family(tmp_path / f, f)
            for f in tokenizer_families.FAMILIES] + [qwen_tokenizer_dir]
    for name, processor in (("bert", processors.BertProcessing(("<|eot_id|>", 404),
                                                               ("<|begin_of_text|>", 400))),
                            ("roberta", processors.RobertaProcessing(
                                ("<|eot_id|>", 404), ("<|begin_of_text|>", 400))),
                            ("eos", processors.Sequence([processors.ByteLevel(),
                                                         processors.TemplateProcessing(
                                single="$A <|eot_id|>", special_tokens=[("<|eot_id|>", 404)])]))):
        tok = Tokenizer.from_file(os.path.join(dirs[0], "tokenizer.json"))
        tok.post_processor = processor
        os.makedirs(tmp_path / name)
        tok.save(str(tmp_path / name / "tokenizer.json"))
        dirs.append(str(tmp_path / name))
    seen = set()
    for path in dirs:
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        before, after = tokenize._post_processor_ids(tok, path)
        assert tid.read_tokenizer(path).around == (*before, tid.TEXT, *after), path
        seen.add((before, after))
    assert len(seen) >= 4  # none, BOS, BERT's both, EOS: the cases differ


def test_a_run_without_commits_is_prepared_again_with_its_changed_tokenizer(
        tmp_path, qwen_tokenizer_dir):
    """Nothing committed: preparing again with a tokenizer whose files changed writes the
    whole token store again and records the tokenizer it was (with commits the same is
    refused: test_advice_followed's damaged token store)."""
    tok = _edited_qwen(qwen_tokenizer_dir, tmp_path / "tok", lambda d: None)
    model = _model(tmp_path / "m")
    run = str(tmp_path / "run")
    assert _prepare(tmp_path, _spec(tmp_path, model, tok), run)[0] == 0
    before = run_dir.open_run(run).spec.tokenizer_identity
    _edited_qwen(qwen_tokenizer_dir, tmp_path / "tok", lambda d: d.update(
        normalizer={"type": "NFKC"}))
    code, out = _prepare(tmp_path, _spec(tmp_path, model, tok), run)
    assert code == 0, out
    after = run_dir.open_run(run).spec.tokenizer_identity
    assert after.normalizer != before.normalizer
    assert after == tid.read_tokenizer(tok).identity()

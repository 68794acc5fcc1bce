"""Chat templates as transformers reads them: chat_template.jinja (what `save_pretrained`
writes now), a `chat_template` in tokenizer_config.json (the legacy layout), named
templates, and chat_template.json. ARC prompts' tokens equal HF's
`apply_chat_template(messages, tokenize=True, add_generation_prompt=True)`; a template the
tokenizer does not have is refused before any work; run.json records the template's hash.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from actx.pipeline import arc_render, chat_templates
from actx.pipeline import main as prepare_main
from actx.pipeline import preflight as pipeline_preflight
from actx.schemas import runspec
from tests import tokenizer_families as families
from tests.test_bos_rule import stored_documents

TASKS = {
    "t1": {"train": [{"input": [[1, 2], [3, 4]], "output": [[4, 3], [2, 1]]}],
           "test": [{"input": [[0, 5], [5, 0]]}]},
    "t2": {"train": [{"input": [[7]], "output": [[7, 7]]},
                     {"input": [[2, 0, 1]], "output": [[2, 0, 1, 2, 0, 1]]}],
           "test": [{"input": [[3, 3]], "output": [[3, 3, 3, 3]]}]},
}


@pytest.fixture(scope="module")
def arc_jsonl(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("arc") / "tasks.jsonl"
    path.write_text("".join(json.dumps({"task_id": k, **v}) + "\n" for k, v in TASKS.items()))
    return str(path)


def _spec(tokenizer, arc: str, **tokenizer_settings) -> runspec.RunSpec:
    return runspec.RunSpec.from_dict({
        "name": "tpl", "model": {"path": ""},
        "tokenizer": {"path": str(tokenizer), **tokenizer_settings},
        "sources": [{"kind": "arc", "paths": [arc]}],
        "packing": {"mode": "pad", "seq_len": 512},
        "layout": {"rows_per_shard": 1, "partition_rows": 1}})


def _hf_prompt(hf, task_id: str, **kwargs) -> list[int]:
    messages = arc_render.build_messages(TASKS[task_id], "digits", False)
    out = hf.apply_chat_template([{"role": r, "content": c.text} for r, c in messages],
                                 tokenize=True, add_generation_prompt=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _prepared(spec, run) -> tuple[dict, dict]:
    prepare_main.run_prepare(spec, str(run))
    docs = stored_documents(str(run))
    return {k.split("/")[0]: v for k, v in docs.items()}, json.loads(
        (run / "run.json").read_text())["tokenizer_identity"]


@pytest.mark.parametrize("family,legacy", [
    ("llama3", False), ("gemma", False), ("qwen2", False), ("gpt2", False),
    ("llama3", True), ("gpt2", True)])
def test_arc_prompts_are_rendered_as_transformers_renders_them(family, legacy, arc_jsonl,
                                                               tmp_path):
    tok = families.save_family(tmp_path / "tok", family, legacy=legacy)
    jinja = os.path.exists(os.path.join(tok, chat_templates.JINJA_FILE))
    assert jinja != legacy  # the layout asked for is the one transformers wrote
    hf = families.hf_tokenizer(tok)
    docs, record = _prepared(_spec(tok, arc_jsonl), tmp_path / "run")
    for task_id in TASKS:
        assert docs[task_id] == _hf_prompt(hf, task_id), (family, legacy, task_id)
    assert record["chat_template"] == (chat_templates.JINJA_FILE if jinja
                                       else "tokenizer_config.json chat_template")
    assert record["chat_template_sha256"] == hashlib.sha256(
        hf.chat_template.encode()).hexdigest()
    if jinja:  # what `sha256sum chat_template.jinja` prints
        assert record["chat_template_sha256"] == hashlib.sha256(
            open(os.path.join(tok, chat_templates.JINJA_FILE), "rb").read()).hexdigest()


@pytest.mark.parametrize("legacy", [False, True])
def test_a_named_template_is_chosen_by_name(legacy, arc_jsonl, tmp_path):
    tok = families.save_family(tmp_path / "tok", "gpt2", legacy=legacy, named=True)
    assert os.path.isdir(os.path.join(tok, "additional_chat_templates")) != legacy
    hf = families.hf_tokenizer(tok)
    docs, record = _prepared(_spec(tok, arc_jsonl, chat_template="plain"), tmp_path / "run")
    for task_id in TASKS:
        assert docs[task_id] == _hf_prompt(hf, task_id, chat_template="plain")
        assert docs[task_id] != _hf_prompt(hf, task_id)
    assert record["chat_template"] == ("tokenizer_config.json chat_template[plain]" if legacy
                                       else "additional_chat_templates/plain.jinja")
    assert record["chat_template_sha256"] == hashlib.sha256(
        families.PLAIN_TEMPLATE.encode()).hexdigest()


def test_the_processors_chat_template_json(arc_jsonl, tmp_path):
    """A multimodal checkpoint's template in chat_template.json beside a tokenizer with
    none of its own (transformers' processors read it)."""
    tok = families.save_family(tmp_path / "tok", "qwen2")
    os.remove(os.path.join(tok, chat_templates.JINJA_FILE))
    with open(os.path.join(tok, chat_templates.PROCESSOR_FILE), "w") as f:
        json.dump({"chat_template": families.LLAMA3_TEMPLATE.replace("bos_token", "'<|im_start|>'")
                   }, f)
    hf = families.hf_tokenizer(tok)
    assert hf.chat_template is None
    template = json.load(open(os.path.join(tok, chat_templates.PROCESSOR_FILE)))["chat_template"]
    docs, record = _prepared(_spec(tok, arc_jsonl), tmp_path / "run")
    for task_id in TASKS:
        assert docs[task_id] == _hf_prompt(hf, task_id, chat_template=template)
    assert record["chat_template"] == chat_templates.PROCESSOR_FILE


def test_a_template_the_tokenizer_lacks_is_refused_before_work(arc_jsonl, tmp_path):
    tok = families.save_family(tmp_path / "tok", "llama3", named=True)
    spec = _spec(tok, arc_jsonl, chat_template="tool_use")
    problems, _, _ = pipeline_preflight.check_inputs(spec)  # what `actx submit` checks first
    with pytest.raises(chat_templates.ChatTemplateError) as e:
        prepare_main.run_prepare(spec, str(tmp_path / "run"))
    assert problems == [str(e.value)]
    assert not (tmp_path / "run").exists()
    message = str(e.value)
    assert message.startswith(f"spec.tokenizer.chat_template: 'tool_use': the tokenizer at "
                              f"{tok} has no chat template of that name (it has 'default', "
                              f"'plain'; looked at ")
    for name in ("chat_template.jinja", "additional_chat_templates/",
                 "tokenizer_config.json (chat_template)", "chat_template.json"):
        assert os.path.join(tok, name) in message


def test_only_named_templates_and_no_default_is_refused_for_prompts(arc_jsonl, tmp_path):
    tok = families.save_family(tmp_path / "tok", "gpt2", named=True)
    os.remove(os.path.join(tok, chat_templates.JINJA_FILE))
    with pytest.raises(chat_templates.ChatTemplateError,
                       match="has only named chat templates .plain. and no default one"):
        prepare_main.run_prepare(_spec(tok, arc_jsonl), str(tmp_path / "run"))
    texts = tmp_path / "t.jsonl"
    texts.write_text(json.dumps({"text": "no prompt to render"}) + "\n")
    spec = runspec.RunSpec.from_dict({**_spec(tok, arc_jsonl).to_dict(), "sources": [
        {"kind": "text", "paths": [str(texts)]}]})
    prepare_main.run_prepare(spec, str(tmp_path / "prose"))  # nothing to choose: it runs


def test_chat_template_false_renders_plain_text(arc_jsonl, tmp_path):
    tok = families.save_family(tmp_path / "tok", "qwen2")
    hf = families.hf_tokenizer(tok)
    docs, record = _prepared(_spec(tok, arc_jsonl, chat_template=False), tmp_path / "run")
    messages = arc_render.build_messages(TASKS["t1"], "digits", False)
    plain = arc_render.render_prompt(messages, None).text
    assert docs["t1"] == hf(plain)["input_ids"]
    assert record["chat_template"] == "" and record["chat_template_sha256"] == ""

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

from actx.pipeline import arc_render, chat_templates, tokenize
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


# Mistral-7B-Instruct-v0.3's template: the system message goes into the LAST user turn
# only, so with an assistant answer after the user turn no system text is rendered at all.
MISTRAL_V3_TEMPLATE = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"] + eos_token}}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported") }}
    {%- endif %}
{%- endfor %}
"""


def _with_template(tmp_path, family: str, template: str) -> str:
    tok = families.save_family(tmp_path / "tok", family)
    with open(os.path.join(tok, chat_templates.JINJA_FILE), "w") as f:
        f.write(template)
    return tok


def _arc_spec(tok, arc: str, **source) -> runspec.RunSpec:
    return runspec.RunSpec.from_dict({**_spec(tok, arc).to_dict(), "sources": [
        {"kind": "arc", "paths": [arc], **source}]})


def _doc_arrays(run) -> dict:
    import zarr

    arrays = {n: zarr.open_array(os.path.join(run, "tokens", n), mode="r")[:]
              for n in ("input_ids", "doc_index", "arc_part", "arc_grid")}
    out = {}
    for name in sorted(os.listdir(run / "docs")):
        for line in (run / "docs" / name).read_text().splitlines():
            doc = json.loads(line)
            at = arrays["doc_index"] == doc["doc_index"]
            out[doc["task_id"]] = {n: arrays[n][at].tolist() for n in arrays}
    return out


def test_a_template_that_leaves_out_the_system_message(arc_jsonl, tmp_path):
    """Mistral v0.3 with the answer in the prompt: transformers renders no system text, and
    neither does prepare; its ids equal apply_chat_template's, no token is attributed to
    the system message, and every grid is still traced. Without an answer (t1 has no
    test output) the system text is in the last user turn, attributed to the system."""
    tok = _with_template(tmp_path, "llama2", MISTRAL_V3_TEMPLATE)
    hf = families.hf_tokenizer(tok)
    spec = _arc_spec(tok, arc_jsonl, arc_include_test_output=True)
    assert pipeline_preflight.check_inputs(spec)[0] == []
    run = tmp_path / "run"
    prepare_main.run_prepare(spec, str(run))
    docs = _doc_arrays(run)
    assert not (run / "rejects").exists() or not os.listdir(run / "rejects")
    system = arc_render.PART["system"]
    for task_id, task in TASKS.items():
        messages = [{"role": r, "content": c.text}
                    for r, c in arc_render.build_messages(task, "digits", True)]
        answered = messages[-1]["role"] == "assistant"
        assert answered == (task_id == "t2")
        ids = hf.apply_chat_template(messages, tokenize=True,
                                     add_generation_prompt=not answered)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert docs[task_id]["input_ids"] == ids, task_id
        rendered = hf.apply_chat_template(messages, tokenize=False)
        assert (arc_render.SYSTEM_PROMPT in rendered) == (not answered)
        parts = docs[task_id]["arc_part"]
        assert (system in parts) == (not answered), task_id  # honest: none when dropped
        grids = {arc_render.GRID[f"{split}_{kind}"] for split in ("train", "test")
                 for pair in task[split] for kind in pair}
        assert set(docs[task_id]["arc_grid"]) - {-1} == grids, task_id
    answer = [p for p, g in zip(docs["t2"]["arc_part"], docs["t2"]["arc_grid"])
              if g == arc_render.GRID["test_output"]]
    assert answer and set(answer) == {arc_render.PART["assistant"]}


def test_render_prompt_attributes_nothing_to_a_dropped_system_message():
    messages = arc_render.build_messages(TASKS["t2"], "digits", True)
    prompt = arc_render.render_prompt(messages, MISTRAL_V3_TEMPLATE,
                                      {"bos_token": "<s>", "eos_token": "</s>"})
    assert prompt.text == ("<s>[INST] " + messages[1][1].text + "[/INST] "
                           + messages[2][1].text + "</s>")
    parts = prompt.char_attrs()[0]
    assert arc_render.PART["system"] not in parts.tolist()
    assert parts[0] == arc_render.PART["user"]  # "<s>[INST] " opens the user's turn


@pytest.mark.parametrize("template,says", [
    # Gemma 2: the system role is refused by the template itself.
    ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System "
     "role not supported') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
     "System role not supported"),
    # A template that renders only the first message: the grids would be lost.
    ("{{ messages[0]['content'] }}", "message content of role 'user' not rendered"),
    # A template that changes the content: the tokens could not be traced to the grids.
    ("{% for m in messages %}{{ m['content'] | lower }}{% endfor %}",
     "it changes the content of role 'system'"),
])
def test_a_template_that_cannot_render_arc_prompts_is_refused_before_work(
        template, says, arc_jsonl, tmp_path):
    tok = _with_template(tmp_path, "llama2", template)
    spec = _arc_spec(tok, arc_jsonl, arc_include_test_output=True)
    problems, _, _ = pipeline_preflight.check_inputs(spec)  # what `actx submit` checks first
    with pytest.raises(tokenize.TokenizerError) as e:
        prepare_main.run_prepare(spec, str(tmp_path / "run"))
    assert problems == [str(e.value)]
    assert not (tmp_path / "run").exists()
    message = str(e.value)
    assert message.startswith(f"{os.path.join(tok, chat_templates.JINJA_FILE)}: the chat "
                              f"template 'default' cannot render the ARC prompts of source "
                              f"'arc0' (messages system, user, assistant): "), message
    assert says in message and "set spec.tokenizer.chat_template to false" in message

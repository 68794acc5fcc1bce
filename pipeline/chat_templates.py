"""A tokenizer directory's chat templates, found where HF transformers finds them, and the
one a run spec asks for.

transformers reads a tokenizer's templates from, in this order of precedence:
  chat_template.jinja (the default template) and additional_chat_templates/NAME.jinja
    (named ones): what `save_pretrained` writes since transformers 4.50, and what recent
    Hub checkpoints ship;
  a `chat_template` in tokenizer_config.json: a string (the default), or a list of
    {"name", "template"} (named ones; "default" is the default): the legacy layout;
  chat_template.json ({"chat_template": ...}): the processor's legacy file, which
    multimodal checkpoints carry beside their tokenizer.
Files of the first kind replace the config's entries wholly, as transformers does.
"""

from __future__ import annotations

import dataclasses
import hashlib

from actx.schemas import errors

JINJA_FILE = "chat_template.jinja"
NAMED_DIR = "additional_chat_templates/"
CONFIG_FILE = "tokenizer_config.json"
PROCESSOR_FILE = "chat_template.json"
DEFAULT = "default"


class ChatTemplateError(errors.UserError, ValueError):
    """The spec asks for a chat template the tokenizer does not have, or one is unreadable."""


@dataclasses.dataclass(frozen=True)
class ChatTemplates:
    """templates: name -> Jinja source ("default" for the default one); sources: name ->
    the file it came from; looked_at: every file and folder searched, for messages."""

    templates: dict
    sources: dict
    looked_at: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SelectedTemplate:
    """The template a run renders its prompts with: its name, source, where it came from
    (e.g. "chat_template.jinja") and the sha256 of its text (what `sha256sum` gives for
    that file)."""

    name: str
    text: str
    source: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def read_templates(store, config: dict | None = None) -> ChatTemplates:
    """The templates of the tokenizer directory behind `store` (an ObjectStore, local or
    gs://); `config`: its tokenizer_config.json when already read."""
    where = store.location
    looked_at = (str(where.join(JINJA_FILE)), f"{where.join(NAMED_DIR.rstrip('/'))}/",
                 f"{where.join(CONFIG_FILE)} (chat_template)", str(where.join(PROCESSOR_FILE)))
    templates, sources = {}, {}
    raw = store.read(JINJA_FILE)
    if raw is not None:
        templates[DEFAULT], sources[DEFAULT] = _text(raw, where.join(JINJA_FILE)), JINJA_FILE
    for key in sorted(store.list(NAMED_DIR)):
        name = key[len(NAMED_DIR):]
        if name.endswith(".jinja") and "/" not in name:
            templates[name[:-len(".jinja")]] = _text(store.read(key), where.join(key))
            sources[name[:-len(".jinja")]] = key
    if templates:
        return ChatTemplates(templates, sources, looked_at)
    if config is None:
        config = store.read_json(CONFIG_FILE) or {}
    entry = config.get("chat_template")
    if isinstance(entry, str):
        return ChatTemplates({DEFAULT: entry}, {DEFAULT: f"{CONFIG_FILE} chat_template"},
                             looked_at)
    if isinstance(entry, list):
        for item in entry:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise ChatTemplateError(f"{where.join(CONFIG_FILE)}: chat_template: expected "
                                        f"a string or a list of {{name, template}}, got "
                                        f"{item!r:.80}")
            templates[item["name"]] = item["template"]
            sources[item["name"]] = f"{CONFIG_FILE} chat_template[{item['name']}]"
        return ChatTemplates(templates, sources, looked_at)
    processor = store.read_json(PROCESSOR_FILE)
    if processor is not None:
        text = processor.get("chat_template") if isinstance(processor, dict) else None
        if not isinstance(text, str):
            raise ChatTemplateError(f"{where.join(PROCESSOR_FILE)}: no \"chat_template\" "
                                    f"string in it")
        return ChatTemplates({DEFAULT: text}, {DEFAULT: PROCESSOR_FILE}, looked_at)
    return ChatTemplates({}, {}, looked_at)


def _text(raw: bytes, where) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"{where}: not UTF-8 text ({e})") from None


def select(found: ChatTemplates, choice: "bool | str", tokenizer_path: str
           ) -> SelectedTemplate | None:
    """The template `spec.tokenizer.chat_template` = `choice` names: false: none; true: the
    default one, none when the tokenizer has no template at all; "NAME": that one. Refuses
    a template the tokenizer does not have (naming the files looked at), and true when the
    tokenizer has only named templates (transformers refuses it too)."""
    if choice is False:
        return None
    names = sorted(found.templates)
    looked = "; looked at " + ", ".join(found.looked_at)
    if choice is True:
        if DEFAULT in found.templates:
            return SelectedTemplate(DEFAULT, found.templates[DEFAULT], found.sources[DEFAULT])
        if names:
            raise ChatTemplateError(
                f"spec.tokenizer.chat_template: true, but the tokenizer at {tokenizer_path} "
                f"has only named chat templates ({', '.join(names)}) and no default one; set "
                f"spec.tokenizer.chat_template to one of those names")
        return None
    if choice in found.templates:
        return SelectedTemplate(choice, found.templates[choice], found.sources[choice])
    has = (f"it has {', '.join(repr(n) for n in names)}" if names
           else "it has no chat template at all")
    raise ChatTemplateError(
        f"spec.tokenizer.chat_template: {choice!r}: the tokenizer at {tokenizer_path} has no "
        f"chat template of that name ({has}{looked}); name one it has, or set true (its "
        f"default) or false (plain text)")


def special_tokens(config: dict) -> dict:
    """The special tokens a template sees by name (bos_token, eos_token, ...), as
    transformers passes them to the template: from tokenizer_config.json."""
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out

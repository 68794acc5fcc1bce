"""What a generating worker needs of the tokenizer: the text of generated ids, and the stop
ids when the run's `generate.stop_token_ids` is unset.

Only tokenizer.json is read (with the `tokenizers` library, as prepare reads it) and
tokenizer_config.json / the chat template for the special tokens; the model's own configs
for its eos ids. Decoding keeps special tokens, so a stop token is in the text it ends.
"""

from __future__ import annotations

import json

from actx.schemas import store as store_lib

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# The tokens chat templates close a turn with; one is a stop token where the tokenizer has
# it as a special token and the run's chat template writes it.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eot|>",
               "<|end_of_turn|>")


class TextDecoder:
    """Token ids to text with the run's tokenizer (special tokens kept)."""

    def __init__(self, tokenizer_path: str):
        from tokenizers import Tokenizer

        store = store_lib.open_store(tokenizer_path)  # the tokenizer's directory, not the run
        data = store.read(TOKENIZER_FILE)
        if data is None:
            raise FileNotFoundError(f"{tokenizer_path}/{TOKENIZER_FILE}: missing; the run's "
                                    f"tokenizer decodes what the model writes")
        self.tokenizer = Tokenizer.from_str(data.decode())
        self.store = store
        self.path = tokenizer_path

    def text(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def special_id(self, token) -> int | None:
        """The id of a special token as tokenizer_config.json names it (a string, or a
        table with its `content`)."""
        if isinstance(token, dict):
            token = token.get("content")
        return self.tokenizer.token_to_id(token) if isinstance(token, str) else None

    def default_stop_ids(self, model_path: str, templated: bool) -> tuple[int, ...]:
        """The model's eos ids (generation_config.json, as HF `generate` stops, then
        config.json), the tokenizer's EOS, and with a chat template its end-of-turn token."""
        ids: set[int] = set()
        model = store_lib.open_store(model_path)  # the model's checkpoint, not the run
        for key in ("generation_config.json", "config.json"):
            config = _json(model, key)
            for c in (config, config.get("text_config") or {}):
                eos = c.get("eos_token_id") if isinstance(c, dict) else None
                ids.update([eos] if isinstance(eos, int) else
                           [i for i in eos or () if isinstance(i, int)])
        config = _json(self.store, TOKENIZER_CONFIG)
        eos = self.special_id(config.get("eos_token"))
        if eos is not None:
            ids.add(eos)
        if templated:
            template = _template_text(self.store, config)
            for token in END_OF_TURN:
                token_id = self.tokenizer.token_to_id(token)
                if token_id is not None and token in template:
                    ids.add(token_id)
        return tuple(sorted(ids))


def _json(store, key: str) -> dict:
    data = store.read(key)
    return json.loads(data) if data else {}


def _template_text(store, config: dict) -> str:
    """Every chat template the tokenizer has, as one text (only searched for tokens)."""
    data = store.read(TEMPLATE_FILE)
    template = config.get("chat_template")
    parts = [data.decode() if data else ""]
    if isinstance(template, str):
        parts.append(template)
    elif isinstance(template, list):
        parts += [t.get("template", "") for t in template if isinstance(t, dict)]
    return "\n".join(parts)

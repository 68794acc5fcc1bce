"""Whether HF transformers' `AutoTokenizer`, where it is installed, encodes text otherwise
than the tokenizer.json that actx encodes with: transformers 5 builds the tokenizer classes
a tokenizer_config.json may name (GPT2Tokenizer, LlamaTokenizer, Qwen2Tokenizer, ...) from
their own code, and where a file's normalizer or pre-tokenizer (or a config's
add_prefix_space) differs from the class's, its ids differ (docs/checkpoints.md). actx
keeps tokenizer.json's, the pipeline the tokenizer was saved with; this says so in the
output of prepare, with an example, so that a comparison with `AutoTokenizer` is not taken for
an error of actx's.

A few probe texts are encoded both ways, once per tokenizer and transformers version
(kept under the actx cache directory: loading a tokenizer through transformers takes
seconds). Without transformers, or for a tokenizer it does not load, nothing is said.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os

from actx.schemas import cache

# What tokenizers' pipelines differ on, one thing a probe, shortest first (the note shows
# the first that differs): a leading space, digits, runs of spaces, contractions, line
# breaks and tabs, Unicode normalisation, scripts without spaces.
PROBES = ("Hello world", "year 2024", " a leading space", "x  y   z", "don't stop",
          "a\nb\n\n\tc\r\nd", "naïve café ﬁne ①", "日本語 and 中文", "pi 3.14159, 1000000")
# The files transformers reads from a tokenizer directory (what the check's answer
# depends on, beside transformers' version).
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
         "chat_template.jinja", "chat_template.json")


def note(tokenizer, directory: str) -> str | None:
    """The note for a local tokenizer `directory` whose tokenizer.json (loaded as
    `tokenizer`, a tokenizers.Tokenizer) encodes a probe otherwise than transformers'
    AutoTokenizer; None when they agree, or transformers is not there to ask."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None
    digest = hashlib.sha256(json.dumps([version, PROBES]).encode())
    for name in FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                digest.update(name.encode() + b"\0" + f.read() + b"\0")
    kept = os.path.join(cache.cache_root(), "tokenizer-checks", f"{digest.hexdigest()}.json")
    try:
        with open(kept) as f:
            return json.load(f)["note"]
    except (OSError, ValueError, KeyError):
        pass
    found = _compare(tokenizer, directory, version)
    if found is not _UNKNOWN:
        os.makedirs(os.path.dirname(kept), exist_ok=True)
        partial = f"{kept}.{os.getpid()}"
        with open(partial, "w") as f:
            json.dump({"note": found}, f)
        os.replace(partial, kept)
        return found
    return None


_UNKNOWN = object()  # transformers could not load it: asked again next time


def _compare(tokenizer, directory: str, version: str):
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        theirs = transformers.AutoTokenizer.from_pretrained(directory)
    except Exception:  # noqa: BLE001 - a tokenizer transformers does not load: not ours to say
        return _UNKNOWN
    for text in PROBES:
        ours = tokenizer.encode(text, add_special_tokens=False).ids
        try:
            hf = list(theirs(text, add_special_tokens=False)["input_ids"])
        except Exception:  # noqa: BLE001
            return _UNKNOWN
        if hf != ours:
            named = type(theirs).__name__
            file = os.path.join(directory, "tokenizer.json")
            return (f"transformers {version}'s AutoTokenizer ({named}) encodes {text!r} "
                    f"as {hf}, and tokenizer.json as {ours}: transformers 5 builds this "
                    f"tokenizer's class from its own code, whose normalizer, pre-tokenizer "
                    f"or add_prefix_space differ from the file's. actx stores "
                    f"tokenizer.json's ids, the pipeline the tokenizer was saved with "
                    f"(docs/checkpoints.md); compare with transformers through "
                    f"PreTrainedTokenizerFast(tokenizer_file={file!r})")
    return None

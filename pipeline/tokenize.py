"""The HF tokenizer (local directory or gs://) and batched encoding of documents.

A document becomes a `TokenizedDoc`: its sort key, int32 token ids with the BOS/EOS policy
of the run spec applied, ARC per-token provenance when it is an ARC prompt, and the fields
of its doc-table row.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import numpy as np

from actx.pipeline import arc_render
from actx.pipeline import sources
from actx.schemas import errors
from actx.schemas import runspec as runspec_lib
from actx.schemas import store as store_lib
from actx.schemas import uri as uri_lib

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


class TokenizerError(errors.UserError, ValueError):
    """The tokenizer directory is missing or unusable."""


def check_tokenizer_path(path: str) -> None:
    """Raises a clear error when `path` has no tokenizer.json (before any work starts)."""
    store = store_lib.open_store(path)
    if not store.exists(TOKENIZER_FILE):
        raise TokenizerError(
            f"{store.location.join(TOKENIZER_FILE)}: tokenizer not found; point --tokenizer at "
            f"an HF tokenizer directory (for Qwen: python -m actx.pipeline.qwen_tokenizer --out DIR)")


@dataclasses.dataclass
class LoadedTokenizer:
    """A tokenizers.Tokenizer with what the run needs from tokenizer_config.json."""

    tokenizer: object
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None
    vocab_size: int
    special_token_ids: tuple[int, ...]


def _token_id(tok, value) -> int | None:
    if isinstance(value, dict):
        value = value.get("content")
    return tok.token_to_id(value) if value else None


_LOADED: dict[tuple, LoadedTokenizer] = {}


def load_tokenizer(path: str) -> LoadedTokenizer:
    """Loads tokenizer.json (+ tokenizer_config.json when present) from a dir or gs://.

    A local directory loads once per process and stays loaded while its files are
    unchanged (the in-process runner's workers share the driver's process).
    """
    loc = uri_lib.parse(path)
    if loc.is_local:
        files = [os.path.join(loc.path, n) for n in (TOKENIZER_FILE, CONFIG_FILE)]
        stamp = (path, *(os.stat(f).st_mtime_ns if os.path.exists(f) else 0 for f in files))
        if stamp not in _LOADED:
            _LOADED.clear()
            _LOADED[stamp] = _load_tokenizer(path)
        return _LOADED[stamp]
    return _load_tokenizer(path)


def _load_tokenizer(path: str) -> LoadedTokenizer:
    from tokenizers import Tokenizer

    loc = uri_lib.parse(path)
    if loc.is_local:
        local_dir = loc.path
    else:
        store = store_lib.open_store(loc)
        local_dir = tempfile.mkdtemp(prefix="actx-tokenizer-")
        for name in (TOKENIZER_FILE, CONFIG_FILE):
            data = store.read(name)
            if data is not None:
                with open(os.path.join(local_dir, name), "wb") as f:
                    f.write(data)
    tok_file = os.path.join(local_dir, TOKENIZER_FILE)
    if not os.path.isfile(tok_file):
        raise TokenizerError(f"{path}: no {TOKENIZER_FILE}")
    tok = Tokenizer.from_file(tok_file)
    config = {}
    if os.path.isfile(os.path.join(local_dir, CONFIG_FILE)):
        with open(os.path.join(local_dir, CONFIG_FILE)) as f:
            config = json.load(f)
    special = sorted(t.id for t in _added_tokens(tok) if t.special)
    return LoadedTokenizer(tok, _token_id(tok, config.get("bos_token")),
                           _token_id(tok, config.get("eos_token")), config.get("chat_template"),
                           tok.get_vocab_size(with_added_tokens=True), tuple(special))


@dataclasses.dataclass(frozen=True)
class _Added:
    id: int
    special: bool


def _added_tokens(tok) -> list[_Added]:
    return [_Added(i, t.special) for i, t in tok.get_added_tokens_decoder().items()]


@dataclasses.dataclass(frozen=True)
class ArcVariantRecord:
    """One augmentation variant of a valid ARC task: one document."""

    task: sources.ArcTaskRecord
    variant: arc_render.Variant


@dataclasses.dataclass(frozen=True)
class TokenizedDoc:
    """key: (source_index, file, line, variant) — the global document order.

    token_ids: int32 [n_tokens]; arc_attrs: int32 [5, n_tokens] (arc_render.CHAR_ATTRS) or
    None; task_id / variant: ARC only; meta: the doc-table fields known before packing.
    """

    key: tuple
    token_ids: np.ndarray
    arc_attrs: np.ndarray | None
    task_id: str | None
    variant: int
    meta: dict

    @property
    def record_key(self) -> tuple:
        return self.key[:3]


def expand_arc_variants(record: sources.ArcTaskRecord, source: runspec_lib.SourceSpec
                        ) -> list[ArcVariantRecord]:
    return [ArcVariantRecord(record, v) for v in arc_render.variants(
        record.task_id, source.arc_dihedral, source.arc_colour_perms, source.arc_seed)]


def _render_arc(item: ArcVariantRecord, source: runspec_lib.SourceSpec, template: str | None
                ) -> arc_render.AttributedText:
    task = arc_render.transform_task(item.task.task, item.variant)
    messages = arc_render.build_messages(task, source.arc_encoder, source.arc_include_test_output)
    return arc_render.render_prompt(messages, template)


def _encode_texts(tokenizer, texts: list[str], with_offsets: bool) -> list:
    """One batched call. Offsets (character spans) serve only ARC provenance; without them
    `encode_batch_fast` gives the same ids for about a quarter less tokenizer time."""
    fast = None if with_offsets else getattr(tokenizer, "encode_batch_fast", None)
    return (fast or tokenizer.encode_batch)(texts, add_special_tokens=False)


def encode_batch(loaded: LoadedTokenizer, spec: runspec_lib.RunSpec,
                 items: list[sources.TextRecord | ArcVariantRecord]) -> list[TokenizedDoc]:
    """Encodes a batch with one batched tokenizer call; applies the BOS/EOS policy."""
    tok_spec = spec.tokenizer
    template = loaded.chat_template if tok_spec.chat_template else None
    texts, rendered = [], []
    for item in items:
        if isinstance(item, ArcVariantRecord):
            source = spec.sources[item.task.source_index]
            prompt = _render_arc(item, source, template)
            rendered.append(prompt)
            texts.append(prompt.text)
        else:
            rendered.append(None)
            texts.append(item.text)
    encodings = _encode_texts(loaded.tokenizer, texts,
                              with_offsets=any(p is not None for p in rendered))
    prefix = [loaded.bos_id] if tok_spec.add_bos and loaded.bos_id is not None else []
    suffix = [loaded.eos_id] if tok_spec.add_eos and loaded.eos_id is not None else []
    out = []
    for item, enc, prompt in zip(items, encodings, rendered):
        ids = np.asarray(prefix + enc.ids + suffix, dtype=np.int32)
        if isinstance(item, ArcVariantRecord):
            rec = item.task
            attrs = arc_render.token_attrs(enc.offsets, prompt.char_attrs())
            pad = lambda n: np.full((attrs.shape[0], n), -1, dtype=np.int32)  # noqa: E731
            attrs = np.concatenate([pad(len(prefix)), attrs, pad(len(suffix))], axis=1)
            meta = {"doc_id": f"{rec.task_id}/v{item.variant.index}", "task_id": rec.task_id,
                    "variant": item.variant.index, "transform": item.variant.description}
            out.append(TokenizedDoc((rec.source_index, rec.file, rec.line, item.variant.index),
                                    ids, attrs, rec.task_id, item.variant.index,
                                    {**meta, "file": rec.file, rec.line_kind: rec.line}))
        else:
            meta = {"doc_id": item.doc_id, "file": item.file, item.line_kind: item.line,
                    **dict(item.provenance)}
            out.append(TokenizedDoc((item.source_index, item.file, item.line, 0), ids, None,
                                    None, 0, meta))
    return out

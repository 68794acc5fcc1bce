"""Whether a tokenizer is the model's: what a tokenizer is (read from its tokenizer.json
with the json module alone), its fingerprint as recorded in run.json, and the checks that
refuse a tokenizer of another model before any work.

A tokenizer of another model is the one mistake that runs to the end and looks right: the
token ids are valid integers, the forward pass runs, verify passes, and every activation
belongs to ids the model was never trained on. So `actx submit` / `actx prepare` check it
before anything starts (deploy.preflight, pipeline.main.run_prepare) and every worker
checks it again against the checkpoint it loads (workers.loop.admission). Shared by pipeline,
workers and deploy, so it lives here and imports neither JAX nor Beam nor `tokenizers`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from actx.schemas import store as store_lib
from actx.schemas import store_errors
from actx.schemas import uri as uri_lib

TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SPECIAL_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# A model's embedding is often padded past its tokenizer's vocabulary (Qwen2.5: 151,665
# ids, 151,936 rows; Phi-3: 32,011 and 32,064), never to twice its size: a tokenizer with
# fewer ids than this fraction of the rows belongs to another model.
MIN_VOCAB_FRACTION = 0.5
OVERRIDE = "spec.tokenizer.allow_model_mismatch: true"
# Stands for the text's own ids in what a post-processor puts around it (`around`).
TEXT = "$A"


def _digest(obj) -> str:
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class TokenizerIdentity:
    """What run.json records about the tokenizer a run was prepared with (spec_version 3).

    fingerprint: hash of the four parts below (as runs before `processing` recorded it).
    vocab_size: distinct ids, added tokens included.
    vocabulary / special_tokens / normalizer / merges: hashes of each part (token -> id;
      the added tokens marked special, with their ids; normalizer and pre-tokenizer; the
      tokenization model's type and merges), so a mismatch can say which part differs.
    processing: hash of what else turns a text into ids (since 0.3.0; "" in runs before):
      the ids the post-processor puts around a text, and each added token's matching
      settings (lstrip, rstrip, single_word, normalized, special). Two tokenizers with
      equal fingerprints and equal processing turn every text into the same ids.

    How the run's documents became ids besides their text (pipeline.tokenize.Rules;
    recorded by prepare since `spec.tokenizer.prepend_bos` exists, absent before; none of
    it enters a fingerprint):
    bos_rule: what decided BOS: "tokenizer" (its tokenizer.json post-processor, as
      transformers' `tokenizer(text)`), "prepend_bos" (the spec), "add_bos" (the rule of
      runs before prepend_bos: BOS on every document).
    prepended / appended: ids put before / after each document not rendered through a
      chat template; prepended_templated / appended_templated: around a chat-templated ARC
      prompt (besides what the template writes; with prepend_bos: true, BOS is left out
      where the template already opens the prompt with it).
    chat_template: where the template ARC prompts were rendered with came from (e.g.
      "chat_template.jinja"; "" for none: plain text, or a run without ARC prompts);
      chat_template_sha256: sha256 of its text (`sha256sum chat_template.jinja`).
    notes: what prepare found worth saying about these rules (e.g. a tokenizer_config.json
      add_bos_token that its tokenizer.json contradicts).
    """

    fingerprint: str
    vocab_size: int
    vocabulary: str
    special_tokens: str
    normalizer: str
    merges: str
    # Not in the fingerprint, whose value runs before it recorded; compared where recorded
    # (`recorded_problems`).
    processing: str = dataclasses.field(default="", compare=False)
    # Records of the run, not parts of the tokenizer: two identities compare by the above.
    bos_rule: str = dataclasses.field(default="", compare=False)
    prepended: tuple[int, ...] | None = dataclasses.field(default=None, compare=False)
    appended: tuple[int, ...] | None = dataclasses.field(default=None, compare=False)
    prepended_templated: tuple[int, ...] | None = dataclasses.field(default=None,
                                                                    compare=False)
    appended_templated: tuple[int, ...] | None = dataclasses.field(default=None,
                                                                   compare=False)
    chat_template: str = dataclasses.field(default="", compare=False)
    chat_template_sha256: str = dataclasses.field(default="", compare=False)
    notes: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def differing_parts(self, other: "TokenizerIdentity") -> list[str]:
        """The parts in which two tokenizers differ; processing only where both record it."""
        parts = [part for part in ("vocabulary", "special_tokens", "normalizer", "merges")
                 if getattr(self, part) != getattr(other, part)]
        if self.processing and other.processing and self.processing != other.processing:
            parts.append("processing")
        return parts

    def same_ids(self, other: "TokenizerIdentity") -> bool:
        """Whether the two make the same ids of every text, as far as both record."""
        return self == other and "processing" not in self.differing_parts(other)


@dataclasses.dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer.json, parsed. vocab: token -> id, added tokens included; special: the
    added tokens marked special, content -> id."""

    location: str
    vocab: dict
    special: dict
    normalizer: object
    pre_tokenizer: object
    model_kind: object
    # What the post-processor puts around a text (`around`), and content -> the matching
    # settings of each added token (`added_settings`).
    around: tuple = (TEXT,)
    added: dict = dataclasses.field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return len(set(self.vocab.values()))

    def identity(self) -> TokenizerIdentity:
        # Computed once per object (hashing a 150k-id vocabulary and its merges takes about
        # 0.4 s), kept beside the fields: equality still compares the fields alone.
        cached = self.__dict__.get("_identity")
        if cached is None:
            parts = {"vocabulary": _digest(sorted(self.vocab.items())),
                     "special_tokens": _digest(sorted(self.special.items())),
                     "normalizer": _digest([self.normalizer, self.pre_tokenizer]),
                     "merges": _digest(self.model_kind)}
            cached = TokenizerIdentity(
                fingerprint=_digest(parts), vocab_size=self.vocab_size, **parts,
                processing=_digest({"around": self.around,
                                    "added": sorted(self.added.items())}))
            object.__setattr__(self, "_identity", cached)
        return cached

    def token(self, token_id: int) -> str | None:
        for content, i in self.vocab.items():
            if i == token_id:
                return content
        return None


def parse(data: dict, location: str) -> TokenizerFiles:
    """A TokenizerFiles from the JSON of a tokenizer.json (any tokenization model)."""
    model = data.get("model") or {}
    raw = model.get("vocab") or {}
    # Unigram stores [piece, score] pairs whose index is the id; the others a dict.
    vocab = ({piece[0]: i for i, piece in enumerate(raw)} if isinstance(raw, list)
             else dict(raw))
    special, settings = {}, {}
    for added in data.get("added_tokens") or ():
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special[added["content"]] = added["id"]
        settings[added["content"]] = added_settings(added, data.get("normalizer") is not None)
    kind = {k: v for k, v in model.items() if k != "vocab"}
    return TokenizerFiles(location, vocab, special, data.get("normalizer"),
                          data.get("pre_tokenizer"), kind,
                          around(data.get("post_processor")), settings)


def around(processor) -> tuple:
    """What a tokenizer.json post-processor does to one text's ids, as data: the ids it
    puts before and after TEXT, e.g. (128000, "$A") for Llama 3's BOS. Post-processors
    that add the same ids are equal here whatever their offset settings (ByteLevel's and
    RoBERTa's trim_offsets change no id); one of a kind not known here is itself."""
    if not processor:
        return (TEXT,)
    try:
        kind = processor.get("type")
        if kind == "ByteLevel":
            return (TEXT,)
        if kind in ("BertProcessing", "RobertaProcessing"):
            return (processor["cls"][1], TEXT, processor["sep"][1])
        if kind == "TemplateProcessing":
            found = []
            for piece in processor["single"]:
                if "Sequence" in piece:
                    found.append(TEXT)
                else:
                    found += processor["special_tokens"][piece["SpecialToken"]["id"]]["ids"]
            return tuple(found)
        if kind == "Sequence":  # each processor's output is the next one's text
            found = (TEXT,)
            for inner in processor["processors"]:
                found = tuple(x for item in around(inner)
                              for x in (found if item == TEXT else (item,)))
            return found
    except (KeyError, IndexError, TypeError, AttributeError):
        pass  # not as `tokenizers` writes it: compared as written
    return (json.dumps(processor, sort_keys=True),)


def added_settings(added: dict, normalizes: bool) -> tuple:
    """How an added token is matched in a text ((special, lstrip, rstrip, single_word,
    normalized), with `tokenizers`' defaults for settings a file leaves out): a token that
    strips the blanks beside it, or matches only a whole word, splits texts into other ids.
    `normalized` (matched in the normalised text) counts only where a normalizer is
    (normalizes): without one, both ways match the same text, and files that two releases
    of transformers saved differ in it."""
    special = bool(added.get("special", False))
    return (special, bool(added.get("lstrip", False)), bool(added.get("rstrip", False)),
            bool(added.get("single_word", False)),
            normalizes and bool(added.get("normalized", not special)))


_SETTINGS = ("special", "lstrip", "rstrip", "single_word", "normalized")


# Local tokenizer.json files parsed in this process, by path and stat: prepare, the
# pre-flight and a worker's admission each read the same one, and a 150k-id tokenizer takes
# about half a second to parse. An edited file has another stat and is read again.
_READ: dict[tuple, "TokenizerFiles | None"] = {}


def read_tokenizer(path: str) -> TokenizerFiles | None:
    """The tokenizer.json under directory `path` (local or gs://); None when it has none.
    Store failures (no credentials, no network) raise store_errors.StoreError. A local
    file is parsed once per process while it is unchanged; treat the result as read-only."""
    loc = uri_lib.parse(path)
    if not loc.is_local:
        return _read_tokenizer(path)
    try:
        st = os.stat(os.path.join(loc.path, TOKENIZER_FILE))
        stamp = (str(path), st.st_mtime_ns, st.st_size, st.st_ino)
    except OSError:  # none there (or unreadable): the store says which
        return _read_tokenizer(path)
    if stamp not in _READ:
        if len(_READ) >= 8:  # a process reads a few tokenizers, not many
            _READ.clear()
        _READ[stamp] = _read_tokenizer(path)
    return _READ[stamp]


def _read_tokenizer(path: str) -> TokenizerFiles | None:
    store = store_lib.open_store(path)
    data = store.read_json(TOKENIZER_FILE)
    if data is None:
        return None
    return parse(data, str(store.location.join(TOKENIZER_FILE)))


def _shown(items: list, most: int = 4) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most
                                      else "")


def differences(mine: TokenizerFiles, model: TokenizerFiles) -> list[str]:
    """How two tokenizers differ, one phrase per part (empty: they are the same)."""
    found = []
    if mine.vocab != model.vocab:
        moved = sum(1 for t, i in mine.vocab.items() if model.vocab.get(t) != i)
        found.append(f"vocabulary: {mine.vocab_size:,} vs {model.vocab_size:,} ids, {moved:,} "
                     f"of its tokens missing from the model's or with another id")
    if mine.special != model.special:
        only_mine = sorted(set(mine.special.items()) - set(model.special.items()))
        only_model = sorted(set(model.special.items()) - set(mine.special.items()))
        shown = [f"only in the model's: {_shown([f'{t!r}={i}' for t, i in only_model])}"] \
            if only_model else []
        shown += [f"only in this one: {_shown([f'{t!r}={i}' for t, i in only_mine])}"] \
            if only_mine else []
        found.append(f"special tokens: {'; '.join(shown)}")
    if (mine.normalizer, mine.pre_tokenizer) != (model.normalizer, model.pre_tokenizer):
        found.append(f"normalizer: {_kind(mine.normalizer)} / {_kind(mine.pre_tokenizer)} vs "
                     f"{_kind(model.normalizer)} / {_kind(model.pre_tokenizer)} "
                     f"(normalizer / pre-tokenizer)")
    if mine.model_kind != model.model_kind:
        found.append(f"model: {mine.model_kind.get('type')} vs {model.model_kind.get('type')}"
                     f" (merges or settings differ)")
    if mine.around != model.around:
        found.append(f"post-processor: puts {_around_shown(mine)}; the model's puts "
                     f"{_around_shown(model)}")
    moved = sorted(content for content, settings in mine.added.items()
                   if content in model.added and model.added[content] != settings)
    if moved:
        found.append("added tokens' settings: " + _shown([
            f"{content!r} " + ", ".join(
                f"{name} {str(a).lower()} vs {str(b).lower()}"
                for name, a, b in zip(_SETTINGS, mine.added[content], model.added[content])
                if a != b)
            for content in moved]))
    return found


def _around_shown(files: TokenizerFiles) -> str:
    """"[128000 '<|begin_of_text|>'] before a text and [] after it"."""
    def named(ids) -> str:
        return "[" + ", ".join(f"{i} {files.token(i)!r}" if isinstance(i, int) else str(i)
                               for i in ids) + "]"

    if files.around.count(TEXT) != 1:
        return str(list(files.around))
    cut = files.around.index(TEXT)
    return (f"{named(files.around[:cut])} before a text and {named(files.around[cut + 1:])} "
            f"after it")


def _kind(part) -> str:
    if not part:
        return "none"
    inner = part.get("normalizers") or part.get("pretokenizers")
    if inner:
        return "+".join(_kind(p) for p in inner)
    return str(part.get("type"))


def special_ids_named(model_path: str) -> list[tuple[str, int]]:
    """(where, id) for each bos/eos/pad id that config.json and generation_config.json of
    the checkpoint name, e.g. ("config.json eos_token_id", 151645)."""
    store = store_lib.open_store(model_path)
    named = []
    for name in ("config.json", GENERATION_CONFIG_FILE):
        try:
            data = store.read_json(name)
        except store_errors.StoreError:
            raise
        except Exception:  # unreadable: config.json's own check says so
            data = None
        for field in SPECIAL_ID_FIELDS:
            value = (data or {}).get(field)
            for token_id in value if isinstance(value, list) else [value]:
                if isinstance(token_id, int) and not isinstance(token_id, bool):
                    named.append((f"{name} {field}", token_id))
    return named


def vocabulary_problems(tokenizer_path: str, tokenizer_vocab: int, special_ids,
                        model_path: str, model_vocab: int | None,
                        named_ids: list[tuple[str, int]], token_name=None,
                        allowed: bool = False) -> list[str]:
    """Whether a tokenizer of `tokenizer_vocab` ids with these special ids fits the model:
    not larger than its embedding, not far smaller, and every bos/eos/pad id the model's
    configs name is one of its special tokens. (An instruct tokenizer's eos next to a base
    model's config is fine: both are special tokens of one vocabulary.)

    allowed: spec.tokenizer.allow_model_mismatch; only a vocabulary larger than the
    embedding is refused then (its ids have no row to look up).
    """
    found = []
    what = f"spec.tokenizer.path: {tokenizer_path}"
    if model_vocab is not None and tokenizer_vocab > model_vocab:
        found.append(
            f"{what}: its vocabulary ({tokenizer_vocab} ids) is larger than the model's "
            f"embedding ({model_vocab} rows, {model_path}); tokenizer and model do not "
            f"belong together")
    if allowed:
        return found
    if model_vocab is not None and tokenizer_vocab < MIN_VOCAB_FRACTION * model_vocab:
        found.append(
            f"{what}: its vocabulary ({tokenizer_vocab:,} ids) is far smaller than the "
            f"model's embedding ({model_vocab:,} rows, {model_path}), "
            f"{tokenizer_vocab / model_vocab:.1%} of it: this tokenizer belongs to another "
            f"model. Point spec.tokenizer.path at the model's tokenizer, or set {OVERRIDE}")
    special_ids = set(special_ids)
    wrong = []
    for where, token_id in named_ids:
        if token_id in special_ids:
            continue
        token = token_name(token_id) if token_name is not None else None
        wrong.append(f"{where}={token_id} is " + (
            f"{token!r}, not a special token" if token is not None else
            "not a special token of it" if token_id < tokenizer_vocab else
            f"beyond its {tokenizer_vocab:,} ids"))
    if wrong:
        found.append(
            f"{what}: not the model's tokenizer: {model_path}'s {'; '.join(wrong)}. Point "
            f"spec.tokenizer.path at the model's tokenizer, or set {OVERRIDE}")
    return found


def same_directory(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def match_problems(mine: TokenizerFiles, tokenizer_path: str, model_path: str,
                   model_vocab: int | None, allowed: bool = False) -> list[str]:
    """Everything that says the tokenizer at `tokenizer_path` is not the model's at
    `model_path`, from both directories' files, before any work (allowed: see
    vocabulary_problems)."""
    found = vocabulary_problems(tokenizer_path, mine.vocab_size, mine.special.values(),
                                model_path, model_vocab,
                                [] if allowed else special_ids_named(model_path), mine.token,
                                allowed)
    if not allowed and not same_directory(tokenizer_path, model_path):
        model_tok = read_tokenizer(model_path)
        if model_tok is not None:
            diff = differences(mine, model_tok)
            if diff:
                found.append(
                    f"spec.tokenizer.path: {tokenizer_path} is not the tokenizer of the model "
                    f"{model_path}, whose own {TOKENIZER_FILE} differs: {'; '.join(diff)}. "
                    f"Point spec.tokenizer.path at {model_path}, or set {OVERRIDE}")
    return found


_PART_NAMES = {"processing": "post-processor or added tokens' settings"}
# The run's rules as prepare records them (pipeline.tokenize.record_rules).
_RULES = ("bos_rule", "prepended", "appended", "prepended_templated", "appended_templated",
          "chat_template_sha256")


def changes_since(recorded: TokenizerIdentity, now: TokenizerIdentity) -> list[str]:
    """How the tokenizer and rules a prepare would use now (`now`) differ from those a
    run's tokens were made with (`recorded`), as far as `recorded` says (a rule absent from
    an earlier run's record is not compared): empty when they make the same ids."""
    def plain(value):
        return list(value) if isinstance(value, (list, tuple)) else value

    found = [_PART_NAMES.get(p, p.replace("_", " ")) for p in recorded.differing_parts(now)]
    for rule in _RULES:
        before, after = plain(getattr(recorded, rule)), plain(getattr(now, rule))
        if before not in (None, "") and before != after:
            found.append(f"{rule} {before} then, {after} now")
    return found



def recorded_problems(recorded: TokenizerIdentity, tokenizer_path: str,
                      model_path: str) -> list[str]:
    """A worker's check of the run's recorded tokenizer against the checkpoint it loads:
    when the checkpoint directory has a tokenizer.json, it must be the one the run's
    tokens were made with."""
    model_tok = read_tokenizer(model_path)
    if model_tok is None:
        return []
    theirs = model_tok.identity()
    if recorded.same_ids(theirs):
        return []
    parts = ", ".join(_PART_NAMES.get(p, p.replace("_", " "))
                      for p in recorded.differing_parts(theirs))
    return [f"the run's tokens were made with the tokenizer at {tokenizer_path} (fingerprint "
            f"{recorded.fingerprint}, {recorded.vocab_size:,} ids), but the model "
            f"{model_path} has its own {TOKENIZER_FILE} (fingerprint {theirs.fingerprint}, "
            f"{theirs.vocab_size:,} ids; {parts} differ). Prepare with the model's tokenizer "
            f"into a new run directory, or set {OVERRIDE}"]

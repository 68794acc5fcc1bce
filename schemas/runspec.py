"""RunSpec: everything that determines a run's bytes, and its fingerprint.

Two runs with equal fingerprints produce identical token stores and activations; a worker
refuses to write into a run whose fingerprint differs from its own spec. Runtime choices
that do not change the bytes (batch size, mesh, host count, concurrency) are not here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Literal

from actx.schemas import config as config_lib
from actx.schemas import generate_spec
from actx.schemas import tokenizer_identity as tokenizer_identity_lib

RUN_SPEC_KEY = "run.json"
# 2: packing.max_context, tokens/context_start, and continuation rows computed with their
# document's earlier tokens. Runs of version 1 computed every row as if its document
# started there; they are refused rather than mixed with version-2 semantics.
# 3: run.json records the tokenizer's identity (`tokenizer_identity`, written by prepare)
# and `tokenizer.allow_model_mismatch`. Version-2 runs stay readable: they have neither,
# so workers check their tokenizer against the model by the manifest's vocabulary and
# special ids only.
SPEC_VERSION = 3
OLDEST_READABLE_SPEC_VERSION = 2
# Fingerprints are computed as in version 2: fields added since then are left out of the
# hash while they hold their default, so the fingerprints of earlier runs stay valid.
FINGERPRINT_SCHEME = 2
DEFAULT_MAX_CONTEXT = 4096


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """One input dataset.

    kind: "fineweb" (parquet with FineWeb's columns), "text" (generic JSONL, parquet or
      plain text), or "arc" (ARC tasks as JSONL, one task per line, or ARC-AGI JSON).
    paths: files, directories or globs, local or gs://. A directory reads its data files
      (.parquet, .jsonl, .ndjson, .json, .txt, in any case) in every folder below it; a
      file there in a format actx cannot read (.gz, .zst, .csv, ...) is refused before any
      work, with a glob that reads the others; other files (README.md) are named as not
      read; hidden ones ("." or "_" first) are left out.
    name: label recorded as provenance; defaults to the kind and position in the list.
    format: "auto" (from the file extension: .parquet, .jsonl/.ndjson, .json, .txt;
      another one reads as JSONL), "parquet", "jsonl" (one JSON object per line), "txt"
      (one document per line) or "json" (a JSON array of objects, one document each; for
      kind arc an ARC-AGI task file). A file that does not fit its format is refused
      before any work.
    text_field: the column (parquet) or key (JSONL, JSON array) that holds each
      document's text (text, fineweb); a record without it is rejected with its keys named.
    id_field: the column or key that holds each document's id (text, fineweb), kept with
      the document; a record without it is named "<file>:<line>" (the file's name; a
      parquet row or an array element: its 0-based position). Ids need not be unique
      (files of one name in two folders share theirs): the doc table also records each
      document's file and line, and the reader's `document(doc_id)` refuses an id that
      names several documents, listing their doc_index.
    max_docs: read at most this many records from this source, in file order: documents
      and rejected inputs alike (None: all).
    arc_encoder: how ARC grids become text: "digits" (rows of digits), "rows" (with row
      numbers) or "shape" (a "HxW" header before the digit rows).
    arc_include_test_output: include the test output grid (the answer) in the prompt.
    arc_dihedral: add the 8 dihedral transforms of each task as separate documents.
    arc_colour_perms: number of colour permutations (fixing colour 0) added per variant.
    arc_seed: seed of the colour permutations.
    """

    kind: Literal["fineweb", "text", "arc"]
    paths: tuple[str, ...]
    name: str = ""
    format: Literal["auto", "parquet", "jsonl", "txt", "json"] = "auto"
    text_field: str = "text"
    id_field: str = "id"
    max_docs: int | None = None
    arc_encoder: Literal["digits", "rows", "shape"] = "digits"
    arc_include_test_output: bool = False
    arc_dihedral: bool = False
    arc_colour_perms: int = 0
    arc_seed: int = 0

    def __post_init__(self):
        if not self.paths:
            raise ValueError("paths: at least one path is required")
        if self.arc_colour_perms < 0:
            raise ValueError("arc_colour_perms: must be >= 0")


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """The HF tokenizer (a directory with tokenizer.json, local or gs://).

    prepend_bos: whether each document opens with the tokenizer's BOS token. Unset (the
      default): the tokenizer's own rule, as HF transformers' `tokenizer(text)` applies it:
      the special tokens its tokenizer.json post-processor puts before a text (Llama 3,
      Gemma, Mistral: BOS; Qwen, GPT-2 and SmolLM: none). A prompt rendered through a chat
      template gets no BOS of actx's then, as `apply_chat_template` gives it none: the
      template writes its own. true / false: always / never (true is refused for a
      tokenizer without a BOS token). run.json records what was applied
      (`tokenizer_identity.bos_rule`).
    add_bos: the spelling of runs made before `prepend_bos` (it was true by default there):
      true prepends the BOS token (when the tokenizer names one in tokenizer_config.json) to
      every document, templated prompts included; false never does. A run.json holding it
      keeps the tokens and fingerprint it had. New specs write `prepend_bos`.
    add_eos: append the EOS token to each document.
    chat_template: how ARC prompts are rendered. true: through the tokenizer's default chat
      template when it has one (chat_template.jinja, a `chat_template` in
      tokenizer_config.json, or chat_template.json, as transformers reads them), as plain
      text when it has none; "NAME": its template of that name (additional_chat_templates/
      NAME.jinja, or a named entry of tokenizer_config.json), refused before any work when
      it has none; false: plain text. run.json records the template's sha256.
    allow_model_mismatch: use this tokenizer although it is not the model's (another
      tokenizer.json than the checkpoint's, a vocabulary far smaller than the embedding,
      bos/eos/pad ids of the model's config that are not its special tokens). Refused
      without it, before any work; recorded in run.json.
    """

    path: str
    add_bos: bool | None = None
    add_eos: bool = False
    chat_template: bool | str = True
    allow_model_mismatch: bool = False
    prepend_bos: bool | None = None

    def __post_init__(self):
        if (self.prepend_bos is not None and self.add_bos is not None
                and self.prepend_bos != self.add_bos):
            raise ValueError(f"prepend_bos ({str(self.prepend_bos).lower()}) and add_bos "
                             f"({str(self.add_bos).lower()}, its old spelling) disagree; "
                             f"give prepend_bos alone")
        if isinstance(self.chat_template, str) and not self.chat_template.strip():
            raise ValueError("chat_template: an empty name; give true, false or the name of "
                             "one of the tokenizer's templates")

    @property
    def bos_choice(self) -> bool | None:
        """What the spec says about BOS: True / False, or None for the tokenizer's rule."""
        return self.prepend_bos if self.prepend_bos is not None else self.add_bos

    @property
    def legacy_bos(self) -> bool:
        """Whether the spec asks for the BOS rule of runs before `prepend_bos` (`add_bos`
        given, `prepend_bos` not): BOS on every document, templated ones included."""
        return self.prepend_bos is None and self.add_bos is not None


@dataclasses.dataclass(frozen=True)
class PackingSpec:
    """How documents become fixed-length rows (see docs/run-directory.md, "What each token sees").

    mode: "pad" (one document per row), "concat" (a stream cut into rows) or
      "segmented" (several documents per row with segment ids and restarting positions).
    seq_len: tokens per row.
    overflow: for "pad" and "segmented", what happens to a document longer than a row:
      "continue" (it continues in following rows) or "truncate" (the rest is dropped and
      counted in the manifest).
    separator: for "concat", tokens put between documents: "eos", "bos" or "none", besides
      what the tokenizer's rules put around each (EOS with add_eos, BOS where the tokenizer
      opens texts with it): the same id there makes every boundary hold it twice, which
      prepare notes (run.json's tokenizer_identity.notes).
    pad_id: token id written into padding positions.
    max_context: the most tokens of its own document a token attends to, itself included
      ("continue" overflow). A token at document position p attends to positions
      max(0, p - max_context + 1) .. p, at every layer, exactly as HF transformers run on
      the whole document with a sliding window of max_context (for a model with its own
      window, the smaller one). Workers carry each document's keys and values across its
      rows in a cache of this many tokens per batch slot, so it must be at least seq_len
      and at most the model's max_position_embeddings. 4096 keeps the cache of a 7B model
      (Llama-3.1-8B: 128 KiB per token in bfloat16) at 0.5 GiB per slot, 4 GiB for 8 slots,
      inside a 16 GB chip beside its share of the weights.
    """

    mode: Literal["pad", "concat", "segmented"] = "segmented"
    seq_len: int = 1024
    overflow: Literal["continue", "truncate"] = "continue"
    separator: Literal["eos", "bos", "none"] = "eos"
    pad_id: int = 0
    max_context: int | None = None

    def __post_init__(self):
        if self.seq_len < 2:
            raise ValueError(f"seq_len: must be at least 2, got {self.seq_len}")
        if self.max_context is None:
            object.__setattr__(self, "max_context", max(DEFAULT_MAX_CONTEXT, self.seq_len))
        if self.max_context < self.seq_len:
            raise ValueError(
                f"max_context: must be at least seq_len ({self.seq_len}), got "
                f"{self.max_context}; a row is always seen whole, so raise max_context or "
                f"lower seq_len")

    @property
    def carries_context(self) -> bool:
        """Whether a document's later rows attend to its earlier rows (pad and segmented
        with "continue"); concat rows are independent streams, truncate has no later rows."""
        return self.mode != "concat" and self.overflow == "continue"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The decoder: an HF checkpoint directory (local or gs://) and its compute dtype.

    flax: instead of a checkpoint, a user's Flax NNX model: "package.module:factory", a
      callable taking no arguments that returns the module with its weights (docs/flax.md,
      "Your own Flax model"). Its own dtypes then decide the compute; `dtype` is not used.
    """

    path: str = ""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    flax: str = ""

    def __post_init__(self):
        if self.flax and self.path:
            raise ValueError("model.path and model.flax: give one (a Hugging Face checkpoint "
                             "directory, or a Flax factory \"package.module:factory\")")
        if self.flax and ":" not in self.flax:
            raise ValueError(f"model.flax: {self.flax!r} names no factory; write "
                             f"\"package.module:factory\"")


@dataclasses.dataclass(frozen=True)
class CaptureConfig:
    """Which activations are stored, and in what dtype.

    hooks: hook names (docs/models.md, "Extraction API"), comma separated, with layer
      ranges allowed: "layers.0-3.resid_post,final_norm" or "layers.*.resid_post";
      TransformerLens names ("blocks.8.hook_resid_pre") where their values are actx's
      (docs/models.md, "TransformerLens names"); the run stores actx's names.
    dtype: storage dtype of the activation arrays; "float8_e4m3" stores one byte a value
      and one float32 scale per token and hook, read back dequantised as float32 or
      bfloat16 (docs/reading.md, "Float8 runs"); "float16" holds values up to ±65,504
      only: a worker refuses a block with values past it (nothing committed).
    """

    hooks: str = "layers.*.resid_post"
    dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3"] = "bfloat16"


@dataclasses.dataclass(frozen=True)
class LayoutSpec:
    """Storage layout of the run's arrays (see schemas.layout).

    rows_per_shard: rows in one stored object of an activation array (a zarr shard). Choose
      it so an object is large (64-512 MB); with several hosts per replica, each host's
      slice of a partition is a whole number of shards.
    partition_rows: rows per partition, a multiple of rows_per_shard.
    chunk_rows: rows per inner chunk (the unit of partial reads), dividing rows_per_shard.
    chunk_tokens: tokens per inner chunk of activation arrays (0: the whole row). A
      shuffled reader decodes a whole inner chunk to return one token, so a few hundred
      tokens per chunk cut its read amplification by seq_len / chunk_tokens; sequential
      readers and the one-writer-per-object rule are unaffected.
    codec: compression of inner chunks: "none", "zstd" or "blosc" (blosc with shuffle).
    codec_level: compression level for zstd / blosc.
    """

    rows_per_shard: int = 8
    partition_rows: int = 64
    chunk_rows: int = 1
    chunk_tokens: int = 0
    codec: Literal["none", "zstd", "blosc"] = "zstd"
    codec_level: int = 3

    def __post_init__(self):
        if self.rows_per_shard < 1 or self.partition_rows < 1 or self.chunk_rows < 1:
            raise ValueError("rows_per_shard, partition_rows and chunk_rows must be positive")
        if self.partition_rows % self.rows_per_shard:
            raise ValueError(
                f"partition_rows ({self.partition_rows}) must be a multiple of rows_per_shard "
                f"({self.rows_per_shard}) so partitions align with stored objects")
        if self.chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0 (0: whole row), got {self.chunk_tokens}")
        if self.rows_per_shard % self.chunk_rows:
            raise ValueError(f"chunk_rows ({self.chunk_rows}) must divide rows_per_shard "
                             f"({self.rows_per_shard})")


# What only extraction uses: a run whose extraction has committed nothing may change these
# without preparing its tokens again (schemas.run_dir.switch_extraction_spec).
EXTRACTION_ONLY_FIELDS = ("model", "capture")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The full specification of a run; `fingerprint` hashes all of it."""

    model: ModelSpec
    tokenizer: TokenizerSpec
    sources: tuple[SourceSpec, ...]
    packing: PackingSpec = PackingSpec()
    capture: CaptureConfig = CaptureConfig()
    layout: LayoutSpec = LayoutSpec()
    name: str = "run"
    # What the files at tokenizer.path were when prepare read them (set by prepare, never
    # by hand; None in runs of spec_version 2). Not part of the fingerprints: it is
    # derived from tokenizer.path, and a worker's spec from the job's config has none.
    tokenizer_identity: tokenizer_identity_lib.TokenizerIdentity | None = None
    # Absent (None) unless the run generates: a spec without it keeps its fingerprint.
    generate: generate_spec.GenerateSpec | None = None

    def __post_init__(self):
        if not self.sources:
            raise ValueError("sources: at least one source is required")
        if self.generate is not None:
            self._check_generate()
        chunk = self.layout.chunk_tokens
        if chunk and chunk < self.packing.seq_len and self.packing.seq_len % chunk:
            raise ValueError(f"layout.chunk_tokens ({chunk}) must divide packing.seq_len "
                             f"({self.packing.seq_len}); 0 or >= seq_len means whole rows")
        names = [s.name or f"{s.kind}{i}" for i, s in enumerate(self.sources)]
        if len(set(names)) != len(names):
            raise ValueError(f"sources: names must be unique, got {names}")

    def _check_generate(self) -> None:
        """What a generating run's token store cannot hold, refused naming the key."""
        packing, gen = self.packing, self.generate
        if packing.mode == "concat":
            raise ValueError("generate: packing.mode \"concat\" runs documents into one "
                             "stream, where no prompt has room to be answered; use "
                             "\"segmented\" or \"pad\"")
        if packing.overflow == "truncate":
            raise ValueError("generate: packing.overflow \"truncate\" would cut answers at "
                             "the row's end; use \"continue\"")
        if gen.max_new_tokens >= packing.max_context:
            raise ValueError(f"generate.max_new_tokens: {gen.max_new_tokens} leaves no room "
                             f"for a prompt in packing.max_context={packing.max_context} "
                             f"tokens; lower it or raise packing.max_context")
        if self.tokenizer.add_eos:
            raise ValueError("generate: tokenizer.add_eos ends every prompt with EOS, after "
                             "which the model has nothing to answer; set it false")
        answered = [s.name or s.kind for s in self.sources
                    if s.kind == "arc" and s.arc_include_test_output]
        if answered:
            raise ValueError(f"generate: source {answered[0]!r} has arc_include_test_output: "
                             f"its prompts hold the answer; set it false")

    def source_name(self, index: int) -> str:
        s = self.sources[index]
        return s.name or f"{s.kind}{index}"

    def to_dict(self) -> dict:
        data = config_lib.to_dict(self)
        if data.get("generate", 0) is None:
            del data["generate"]  # absent unless the run generates
        elif data.get("generate") and data["generate"]["repetition_penalty"] == 1.0:
            # Absent while off, so generating runs written before it keep their fingerprint.
            del data["generate"]["repetition_penalty"]
        if not data["model"]["flax"]:
            # Absent unless used, so specs written before model.flax keep their fingerprint.
            del data["model"]["flax"]
        for key in ("add_bos", "prepend_bos"):
            # Absent unless given: a run.json of an earlier actx always holds add_bos and
            # keeps its fingerprint; a spec that leaves BOS to the tokenizer hashes neither.
            if data["tokenizer"][key] is None:
                del data["tokenizer"][key]
        return data

    @classmethod
    def from_dict(cls, data: dict, where: str = "run spec: ") -> "RunSpec":
        data = dict(data)
        data.pop("fingerprint", None)
        data.pop("spec_version", None)
        return config_lib.from_dict(cls, data, where)

    def _hashed_dict(self) -> dict:
        """to_dict without what the fingerprints leave out (FINGERPRINT_SCHEME)."""
        data = self.to_dict()
        data.pop("tokenizer_identity")
        if not data["tokenizer"]["allow_model_mismatch"]:
            del data["tokenizer"]["allow_model_mismatch"]
        return data

    @property
    def fingerprint(self) -> str:
        canonical = json.dumps(self._hashed_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(
            f"actx-v{FINGERPRINT_SCHEME}:{canonical}".encode()).hexdigest()[:16]

    @property
    def tokens_fingerprint(self) -> str:
        """The token store's identity: every field but those only extraction uses
        (EXTRACTION_ONLY_FIELDS). Two specs with equal tokens fingerprints prepare identical
        token stores, so a run may switch between them while nothing is committed."""
        data = {k: v for k, v in self._hashed_dict().items() if k not in EXTRACTION_ONLY_FIELDS}
        data["tokenizer"].pop("allow_model_mismatch", None)  # a permission, not a token
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(
            f"actx-tokens-v{FINGERPRINT_SCHEME}:{canonical}".encode()).hexdigest()[:16]

    def extraction_changes(self, other: "RunSpec") -> list[str]:
        """Dotted keys of the extraction-only fields in which `other` differs from this."""
        mine, theirs = self.to_dict(), other.to_dict()
        return sorted(f"{field}.{key}" for field in EXTRACTION_ONLY_FIELDS
                      for key in set(mine[field]) | set(theirs[field])
                      if mine[field].get(key) != theirs[field].get(key))

    def to_json_obj(self) -> dict:
        return {**self.to_dict(), "spec_version": SPEC_VERSION, "fingerprint": self.fingerprint}


def read_run_spec(store) -> RunSpec:
    """Reads run.json from an ObjectStore, with a clear error when it is not an actx run."""
    data = store.read_json(RUN_SPEC_KEY)
    where = str(store.location.join(RUN_SPEC_KEY))
    if data is None:
        raise FileNotFoundError(
            f"{store.location}: not an actx run (no {RUN_SPEC_KEY}); check the path, or "
            f"prepare it first: `actx submit` with your config prepares and extracts it")
    version = data.get("spec_version", 1)
    if version < OLDEST_READABLE_SPEC_VERSION:
        raise ValueError(
            f"{where}: prepared by an older actx (spec_version {version}, this actx writes "
            f"{SPEC_VERSION}): it has no packing.max_context and its token store has no "
            f"tokens/context_start, and it computed each row of a long document as if the "
            f"document started there. Prepare the data again into a new run directory")
    spec = RunSpec.from_dict(data, where + ": ")
    if data.get("fingerprint") not in (None, spec.fingerprint):
        raise ValueError(f"{where}: recorded fingerprint {data['fingerprint']} does not match "
                         f"its contents ({spec.fingerprint}); the file was edited by hand")
    return spec

"""Where everything lives in a run directory, and the zarr v3 layout of its arrays.

The one place that names keys, array names, chunk and shard shapes. Token arrays are
sharded one stored object per partition; activation arrays one object per
`rows_per_shard` rows, so partitions (and each host's slice of one) align with objects and
every object is written by exactly one process.
"""

from __future__ import annotations

import copy
import dataclasses
import re

from actx.schemas import chunk_checksums
from actx.schemas import runspec as runspec_lib
from actx.schemas import uri as uri_lib

MANIFEST_KEY = "manifest.json"
TOKENS_GROUP = "tokens"
ACTIVATIONS_GROUP = "activations"
COMMITS_PREFIX = "commits/"
WORKERS_PREFIX = "workers/"
CLAIMS_PREFIX = "claims/"  # claims/<job>/p-00042.json: work stealing within one job
LOGS_PREFIX = "logs/"  # logs/<job>/<host>.log
# One JSON object per change made to a prepared run (schemas.run_dir.record_change): an
# extraction spec switched before any commit, numerics replaced before any commit.
CHANGES_PREFIX = "changes/"
REJECTS_PREFIX = "rejects/"
DOCS_PREFIX = "docs/"
STATS_KEY = "stats.json"
# Written by the reader's compute_stats (reader.masks): per hook, the L2 norm of every
# token's activation, float32 [rows, seq_len] (0 at padding), for the "outlier" mask; the
# partitions it covers, the hook's median norm and each mask's token counts are in
# stats.json ("norm_partitions", "norm_median", "masks"). MASKS_VERSION counts changes.
MASKS_GROUP = "masks"
MASKS_VERSION = 1
VERIFY_RECORD_KEY = "verify/latest.json"  # schemas.verification: what `actx verify` found
# One JSON object per `actx verify --repair`: when, which partitions, the problems found
# and the commit markers it deleted (kept here, since the markers themselves are gone).
VERIFY_REPAIRS_PREFIX = "verify/repairs/"
# Written once (create-only) by the first worker: fingerprint, hooks -> hidden size, dtype,
# and the numerics key (see workers.loop.runner) that every later attempt must share.
ACTIVATIONS_INFO_KEY = f"{ACTIVATIONS_GROUP}/actx.json"
PREPARE_SUMMARY_KEY = "prepare/summary.json"  # staged by the pipeline for its driver
# Each input file's path and size as the prepare read them (pipeline/preflight.py;
# since 0.3.0): what a submit that skips the prepare compares with the inputs now.
PREPARE_INPUTS_KEY = "prepare/inputs.json"
# Everything a prepare attempt writes besides run.json and manifest.json: a new attempt
# deletes what a failed one left here, so a retry never meets arrays of another shape or
# rejects of inputs it did not read.
PREPARE_OUTPUT_PREFIXES = (f"{TOKENS_GROUP}/", DOCS_PREFIX, REJECTS_PREFIX, "prepare/")
# Written by prepare before anything else: only a directory holding it (or run.json) has
# its prefixes above cleared, so a user's own docs/ or tokens/ are never deleted.
PREPARE_ATTEMPT_KEY = "prepare/attempt.json"
# One job at a time (schemas.job_lease): the job extracting the run, its hosts, who
# started it and until when it holds the run (renewed by its launcher, and kept alive by
# its hosts' heartbeats). Create-only; taken over only once expired, through a create-only
# takeover object under leases/ named after the expired lease, so two takers never both win.
JOB_LEASE_KEY = "job_lease.json"
# How the latest job launched its workers (optional; deploy/launch_record.py).
LAUNCH_KEY = "launch.json"
JOB_LEASE_TAKEOVERS_PREFIX = "leases/"

# Several extractions over one token store (one per model and capture spec, e.g. a base
# and a chat model for a crosscoder). A run's root keeps today's layout: it is the default
# extraction, whose spec is the root run.json. A named extraction keeps its own copies of
# the keys in EXTRACTION_KEYS under extractions/<name>/ (its run.json: the run's spec with
# its own model and capture; its activations/, actx.json, commits/, claims/, heartbeats,
# stats, masks and verify record); the token store, manifest, docs and logs stay shared.
# EXTRACTIONS_VERSION counts changes to this layout (1: the first).
EXTRACTIONS_PREFIX = "extractions/"
EXTRACTIONS_VERSION = 1
# One small object per named extraction, so the names come from a listing of a few keys,
# not of every stored object under extractions/ ("_" starts no extraction name).
EXTRACTION_NAMES_PREFIX = f"{EXTRACTIONS_PREFIX}_names/"
# A generating run's per-partition record of its samples (`generated_key`), under each
# extraction: each model writes its own text into the positions prepare reserved.
GENERATED_PREFIX = "generated/"
EXTRACTION_KEYS = (runspec_lib.RUN_SPEC_KEY, f"{ACTIVATIONS_GROUP}/", COMMITS_PREFIX,
                   CLAIMS_PREFIX, WORKERS_PREFIX, f"{MASKS_GROUP}/", STATS_KEY, "verify/",
                   GENERATED_PREFIX)
_EXTRACTION_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")


def check_extraction_name(name: str) -> str:
    """`name` when it can name an extraction (a key segment), else ValueError."""
    if not _EXTRACTION_NAME.fullmatch(name or "") or name in ("all", "default"):
        raise ValueError(f"extraction name {name!r}: use 1-40 lower-case letters, digits, "
                         f"'-' or '_', starting with a letter or digit (e.g. base, chat), "
                         f"other than 'all' and 'default' (commands' names for every "
                         f"extraction and for the run's root one)")
    return name


def extraction_name_key(name: str) -> str:
    """The object that says extraction `name` exists (written after its run.json)."""
    return f"{EXTRACTION_NAMES_PREFIX}{check_extraction_name(name)}.json"


def extraction_prefix(name: str) -> str:
    """Where a named extraction keeps its keys ("" for the default extraction)."""
    return f"{EXTRACTIONS_PREFIX}{check_extraction_name(name)}/" if name else ""


def extraction_key(name: str, key: str) -> str:
    """`key` (a run-directory key of the default layout) as extraction `name` stores it:
    under its prefix when the key is one of an extraction's own (EXTRACTION_KEYS), as it
    is otherwise (the shared token store, manifest, docs, heartbeats, logs)."""
    if not name or not any(key == k or (k.endswith("/") and key.startswith(k))
                           for k in EXTRACTION_KEYS):
        return key
    return extraction_prefix(name) + key


# Token arrays written by prepare, all int32 [rows, seq_len].
#   input_ids: token ids (pad_id at padding).
#   segment_ids: 0 = padding, 1.. = document segment within the row.
#   positions: position inside its document (restarts per segment; 0 at padding). In
#     `concat` packing a row is one causal sequence across documents, so positions are the
#     column index and workers treat every non-padding token as one segment.
#   doc_index: run-wide document number (index into the doc table), -1 at padding.
#   context_start: the first position of its own document that the token attended to, -1
#     at padding. 0 means the token saw its whole document up to itself. "continue" rows:
#     max(0, position - packing.max_context + 1); "truncate": 0; "concat": the document
#     position of the document's first token in the row (a concat row is one causal
#     stream, so a token there also saw the documents before it in the row).
TOKEN_ARRAYS = ("input_ids", "segment_ids", "positions", "doc_index", "context_start")

# ARC provenance per token, int32 [rows, seq_len], -1 where not applicable:
#   arc_task: index into the task table in the manifest (manifest["arc_tasks"]).
#   arc_variant: augmentation variant number of the document (0 = the original task).
#   arc_part: ARC_PARTS index (system / user / assistant part of the prompt).
#   arc_example: index of the train pair, or of the test pair for test grids.
#   arc_grid: ARC_GRIDS index (which grid the token encodes), -1 outside grids.
#   arc_row / arc_col: the cell a token encodes, -1 for tokens that are not a cell.
ARC_ARRAYS = ("arc_task", "arc_variant", "arc_part", "arc_example", "arc_grid",
              "arc_row", "arc_col")
ARC_PARTS = ("system", "user", "assistant")
ARC_GRIDS = ("train_input", "train_output", "test_input", "test_output")

ALL_TOKEN_ARRAYS = TOKEN_ARRAYS + ARC_ARRAYS


def token_array_names(has_arc: bool) -> tuple[str, ...]:
    """The token arrays prepare writes: the ARC arrays only in a run with an ARC source
    (elsewhere they would hold -1 only). Readers treat an absent ARC array as all -1."""
    return ALL_TOKEN_ARRAYS if has_arc else TOKEN_ARRAYS
TOKEN_FILL = {"input_ids": 0, "segment_ids": 0, "positions": 0}  # others fill with -1


def partition_name(partition_id: int) -> str:
    return f"p-{partition_id:05d}"


def commit_key(partition_id: int) -> str:
    return f"{COMMITS_PREFIX}{partition_name(partition_id)}.json"


def heartbeat_key(host: str) -> str:
    return f"{WORKERS_PREFIX}{host}.json"


def claim_key(job: str, partition_id: int) -> str:
    """A work-stealing claim: which attempt of `job` took the partition (create-only)."""
    return f"{CLAIMS_PREFIX}{job}/{partition_name(partition_id)}.json"


def change_key(name: str) -> str:
    return f"{CHANGES_PREFIX}{name}.json"


def log_key(job: str, host: str) -> str:
    """A worker host's log of one job."""
    return f"{LOGS_PREFIX}{job}/{host}.log"


def log_lines_key(job: str) -> str:
    """What status last read at the end of each host log of a job, with the log's version:
    a preempted slice's silent hosts are read once, not at every refresh (a cache: deleting
    it costs one slower status)."""
    return f"{LOGS_PREFIX}{job}/last-lines.json"


def docs_key(partition_id: int) -> str:
    """The doc table rows of the documents that start in a partition (JSONL)."""
    return f"{DOCS_PREFIX}{partition_name(partition_id)}.jsonl"


# A generating run (run.json's `generate`): the ids the model wrote, stored as an int32
# activation array of width 1 beside the hooks (written, checksummed and committed with
# them): the generated id at each generated position, GENERATED_PROMPT (-1) at prompt
# tokens and padding, GENERATED_UNUSED (-2) at positions reserved for a sample that
# stopped before them (their activations are zero; readers drop them as padding).
GENERATED_IDS = "generated.token_ids"
GENERATED_PROMPT = -1
GENERATED_UNUSED = -2
# GENERATED_VERSION counts changes to the generation record (generated/p-NNNNN.json).
GENERATED_VERSION = 1


def generated_key(partition_id: int) -> str:
    """A generating run's record of the samples whose documents start in a partition:
    their ids, text, why each stopped, and an ARC answer's verdict (JSON)."""
    return f"{GENERATED_PREFIX}{partition_name(partition_id)}.json"


def token_array_key(name: str) -> str:
    return f"{TOKENS_GROUP}/{name}"


def activation_array_key(hook: str) -> str:
    return f"{ACTIVATIONS_GROUP}/{hook}"


def norms_array_key(hook: str) -> str:
    """Per-token activation norms of a hook (see MASKS_GROUP)."""
    return f"{MASKS_GROUP}/norms/{hook}"


# zarr v3's default chunk key encoding names an array's stored objects c/<i>/<j>/...; an
# activation shard spans the whole [seq_len, hidden] plane, so its key is c/<i>/0/0.
SHARD_OBJECTS = "c/"


def activation_shard_prefix(hook: str) -> str:
    """The prefix under which a hook array's stored shard objects are listed."""
    return f"{activation_array_key(hook)}/{SHARD_OBJECTS}"


def activation_shard_key(hook: str, shard_index: int) -> str:
    """The stored object holding shard `shard_index` (rows_per_shard rows) of a hook."""
    return f"{activation_shard_prefix(hook)}{shard_index}/0/0"


def shard_index_of(hook: str, key: str) -> int | None:
    """The shard index of a key listed under `activation_shard_prefix(hook)`, else None."""
    first = key[len(activation_shard_prefix(hook)):].split("/", 1)[0]
    return int(first) if first.isdigit() else None


def _codecs(layout: runspec_lib.LayoutSpec, itemsize: int) -> list[dict]:
    codecs: list[dict] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if layout.codec == "zstd":
        codecs.append({"name": "zstd", "configuration": {"level": layout.codec_level}})
    elif layout.codec == "blosc":
        codecs.append({"name": "blosc", "configuration": {
            "cname": "zstd", "clevel": layout.codec_level, "shuffle": "shuffle",
            "typesize": itemsize, "blocksize": 0}})
    return codecs


# Bytes per value, by stored data type (and by capture dtype where the two names differ:
# float8_e4m3 is stored as zarr's float8_e4m3fn, schemas.quantised).
ITEMSIZE = {"int32": 4, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1,
            "float8_e4m3": 1}


def _sharded_metadata(shape: list[int], dtype: str, shard_shape: list[int],
                      chunk_shape: list[int], layout: runspec_lib.LayoutSpec,
                      fill_value, chunk_checksum: bool = False) -> dict:
    return {
        "shape": shape,
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": shard_shape}},
        "chunk_key_encoding": {"name": "default"},
        "fill_value": fill_value,
        "codecs": [{
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": chunk_shape,
                "codecs": (_codecs(layout, ITEMSIZE[dtype])
                           + ([chunk_checksums.CODEC] if chunk_checksum else [])),
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                 {"name": "crc32c"}],
                "index_location": "end",
            },
        }],
    }


def array_spec(run: uri_lib.Location, key: str, **options) -> dict:
    """The tensorstore spec that opens the zarr v3 array at `key` of a run; `options` adds
    spec members (e.g. recheck_cached_data)."""
    return {"driver": "zarr3", "kvstore": run.join(key).kvstore(directory=True), **options}


@dataclasses.dataclass(frozen=True)
class ArrayLayout:
    """A zarr v3 array of the run: its key and tensorstore metadata."""

    key: str
    metadata: dict

    def spec(self, run: uri_lib.Location, create: bool = False) -> dict:
        """A tensorstore spec that opens (or creates, when `create`) this array; one whose
        chunks carry checksums is written with every chunk stored (schemas.chunk_checksums)."""
        spec = array_spec(run, self.key)
        if create:
            spec.update({"metadata": self.metadata, "create": True, "open": True})
            if chunk_checksums.in_metadata(self.metadata):
                spec.update(chunk_checksums.WRITE_EVERY_CHUNK)
        return spec

    def specs(self, run: uri_lib.Location, create: bool = False) -> list[dict]:
        """`spec`, then the same for the array as an actx before 0.3.0 wrote it (its inner
        chunks without a checksum): what a writer opens an existing array with when the
        first is refused for its codecs (ts_context.open_array_as_stored)."""
        earlier = copy.deepcopy(self.metadata)
        for codec in earlier["codecs"]:
            inner = codec.get("configuration", {}).get("codecs")
            if inner is not None and chunk_checksums.CODEC in inner:
                inner.remove(chunk_checksums.CODEC)
        return [self.spec(run, create),
                dataclasses.replace(self, metadata=earlier).spec(run, create)]


def token_array(name: str, total_rows: int, seq_len: int,
                layout: runspec_lib.LayoutSpec) -> ArrayLayout:
    """One object per partition: prepare writes each partition from one bundle."""
    shard = [layout.partition_rows, seq_len]
    chunk = [layout.rows_per_shard, seq_len]
    fill = TOKEN_FILL.get(name, -1)
    return ArrayLayout(token_array_key(name),
                       _sharded_metadata([total_rows, seq_len], "int32", shard, chunk, layout, fill,
                                         chunk_checksum=True))


def norms_array(hook: str, total_rows: int, seq_len: int,
                layout: runspec_lib.LayoutSpec) -> ArrayLayout:
    """float32 [rows, seq_len], one object per partition like the token arrays."""
    shard = [layout.partition_rows, seq_len]
    chunk = [layout.rows_per_shard, seq_len]
    return ArrayLayout(norms_array_key(hook),
                       _sharded_metadata([total_rows, seq_len], "float32", shard, chunk,
                                         layout, 0.0))


def activation_array(hook: str, total_rows: int, seq_len: int, hidden: int, dtype: str,
                     layout: runspec_lib.LayoutSpec) -> ArrayLayout:
    """One object per `rows_per_shard` rows; inner chunks of `chunk_rows` rows and
    `chunk_tokens` tokens (the whole row when 0)."""
    shard = [layout.rows_per_shard, seq_len, hidden]
    chunk = [layout.chunk_rows, min(layout.chunk_tokens or seq_len, seq_len), hidden]
    # NaN would be a better "never written" marker, but zarr3 fill must be representable
    # in every dtype; 0 is, and verify detects unwritten blocks through missing objects.
    return ArrayLayout(activation_array_key(hook),
                       _sharded_metadata([total_rows, seq_len, hidden], dtype, shard, chunk,
                                         layout, 0))


def host_row_slices(row_start: int, row_count: int, hosts: int,
                    rows_per_shard: int) -> list[tuple[int, int]]:
    """Each host's contiguous, object-aligned [start, stop) slice of a partition.

    Slices are whole shards (the last may be short or empty), so no stored object is
    written by two hosts.
    """
    shards = -(-row_count // rows_per_shard)
    per_host = -(-shards // hosts)
    slices = []
    for h in range(hosts):
        lo = min(row_count, h * per_host * rows_per_shard)
        hi = min(row_count, (h + 1) * per_host * rows_per_shard)
        slices.append((row_start + lo, row_start + hi))
    return slices


def padding_share(partition_rows: int, rows_per_shard: int, hosts: int) -> float:
    """The share of a replica's host-steps that pad, over a full partition split by
    `host_row_slices` over its `hosts`: a host whose slice holds fewer objects than the
    busiest steps along with it (0 where the objects divide evenly)."""
    shards = -(-partition_rows // rows_per_shard)
    per_host = -(-shards // hosts)
    return 1 - shards / (hosts * per_host)


def reject_kind(reason: str) -> str:
    """A reject's kind of reason, its words before any detail ("not valid JSON: line 3"
    -> "not valid JSON"): what prepare's summary and the live page count rejects by."""
    return reason.split(":")[0].split(" (")[0]

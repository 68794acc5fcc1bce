"""A synthetic, contract-exact run for the reader's tests and bench (no model needed).

`build_run` writes run.json, manifest.json, the token and ARC arrays, doc tables,
activations and commit markers exactly as schemas.layout names them, and returns the
ground truth in memory. Activation values encode their token: at (row, col, dim) hook k
holds sign_k * (row * seq_len + col + 1 + dim / 16) (exact in float32), so a test can
tell which token it got back; padding holds PAD_VALUE, which must never be returned.
"""

from __future__ import annotations

import dataclasses
import json
import time

import ml_dtypes
import numpy as np
import pytest

from actx.schemas import commit as commit_lib
from actx.schemas import quantised
from actx.schemas import layout
from actx.schemas import manifest as manifest_lib
from actx.schemas import runspec as runspec_lib
from actx.schemas import store as store_lib
from actx.schemas import ts_context

BOS_ID, EOS_ID, PAD_ID = 1, 2, 0
SPECIAL_IDS = (BOS_ID, EOS_ID)
PAD_VALUE = -9999.0
ARC_TASKS = ("task_a", "task_b")
DEFAULT_HOOKS = ("layers.0.resid_post", "embed")


@dataclasses.dataclass
class RunTruth:
    """What was written: token arrays (name -> [rows, T]), docs, hooks, committed ids."""

    uri: str
    seq_len: int
    hidden: int
    hooks: tuple[str, ...]
    dtype: str
    tokens: dict[str, np.ndarray]
    docs: list[dict]
    committed: tuple[int, ...]
    partition_rows: int
    num_partitions: int
    # What build_run stored, so a test can commit a partition later (commit_partition).
    stored: dict | None = None
    fingerprint: str = ""
    rows_per_shard: int = 0
    # Every stored array as written (a float8 run: its values and `<hook>.scale` arrays;
    # `stored` then holds what readers return, the dequantised float32), and its data type.
    arrays: dict | None = None
    array_dtypes: dict | None = None

    def committed_mask(self) -> np.ndarray:
        """[rows, T] True at valid tokens of committed partitions."""
        mask = self.tokens["segment_ids"] > 0
        part = np.arange(mask.shape[0]) // self.partition_rows
        return mask & np.isin(part, self.committed)[:, None]

    def value(self, hook: str, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Expected activations [n, hidden] at (rows, cols), in the stored dtype."""
        return encode(self.hooks.index(hook), np.asarray(rows), np.asarray(cols),
                      self.seq_len, self.hidden).astype(np_dtype(self.dtype))


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def encode(hook_number: int, rows: np.ndarray, cols: np.ndarray, seq_len: int,
           hidden: int) -> np.ndarray:
    sign = 1.0 if hook_number % 2 == 0 else -1.0
    flat = (rows * seq_len + cols + 1).astype(np.float32)
    return sign * (flat[..., None] + np.arange(hidden, dtype=np.float32) / 16)


def decode_flat(values: np.ndarray, seq_len: int) -> np.ndarray:
    """Row-major token number (row * seq_len + col) from float32 activations [n, hidden]."""
    return (np.abs(values[:, 0]).astype(np.int64) - 1)


def _pack(rng: np.random.Generator, total_rows: int, seq_len: int, arc_every: int,
          mode: str = "segmented"):
    """Segmented packing with 'continue' overflow: several docs per row, padded row ends.

    mode="concat": one stream cut into rows (documents, each opening with BOS, go on
    where the previous one ended, so BOS tokens sit mid-row); positions are the column
    index and segment ids number the document runs within a row, as pipeline.pack does.
    """
    concat = mode == "concat"
    shape = (total_rows, seq_len)
    arrays = {n: np.full(shape, layout.TOKEN_FILL.get(n, -1), np.int32)
              for n in layout.ALL_TOKEN_ARRAYS}
    docs = []
    row, col, seg = 0, 0, 0
    while row < total_rows:
        d = len(docs)
        is_arc = arc_every and d % arc_every == 1
        if is_arc:
            ids, arc = _arc_doc(rng, d)
        else:
            n = int(rng.integers(2, seq_len + seq_len // 2))
            ids = np.concatenate([[BOS_ID], rng.integers(3, 1000, n - 1)]).astype(np.int32)
            if rng.random() < 0.5:
                ids[-1] = EOS_ID
            arc = None
        n = len(ids)
        if not concat and n <= seq_len and col + n > seq_len:  # does not fit: pad the row
            row, col, seg = row + 1, 0, 0
            if row >= total_rows:
                break
        doc = {"doc_index": d, "doc_id": f"doc-{d}", "source": "arc0" if is_arc else "text0",
               "file": "synthetic.jsonl", "line": d, "n_tokens": n,
               "first_row": row, "first_col": col}
        if is_arc:
            doc["arc_task"] = ARC_TASKS[d % len(ARC_TASKS)]
        placed, seg = 0, seg + 1
        while placed < n and row < total_rows:
            take = min(n - placed, seq_len - col)
            sl = (row, slice(col, col + take))
            arrays["input_ids"][sl] = ids[placed:placed + take]
            arrays["segment_ids"][sl] = seg
            arrays["positions"][sl] = (np.arange(col, col + take) if concat
                                       else np.arange(placed, placed + take))
            arrays["doc_index"][sl] = d
            if concat:  # as pipeline.pack: the document position of its first token here
                arrays["context_start"][sl] = placed
            if arc is not None:
                for name, values in arc.items():
                    arrays[name][sl] = values[placed:placed + take]
            placed, col = placed + take, col + take
            if col == seq_len:
                row, col, seg = row + 1, 0, 1
        if placed < n:  # ran off the end of the store: truncate the last doc's count
            doc["n_tokens"] = placed
        docs.append(doc)
        if col == 0:
            seg = 0
    return arrays, docs


def _arc_doc(rng: np.random.Generator, d: int):
    """BOS, one system token, then three 2x2 grids (train_input, train_output, test_input)
    each followed by a newline token per grid row: 20 tokens, so it overflows a 16-row."""
    ids, arc = [BOS_ID, 5], {n: [] for n in layout.ARC_ARRAYS}

    def add(part, example, grid, r, c):
        for name, v in zip(layout.ARC_ARRAYS, (d % len(ARC_TASKS), d % 2, part, example,
                                               grid, r, c)):
            arc[name].append(v)

    add(0, -1, -1, -1, -1)
    add(0, -1, -1, -1, -1)
    for grid in (0, 1, 2):
        for r in range(2):
            for c in range(2):
                ids.append(int(rng.integers(10, 20)))
                add(1 if grid < 2 else 2, 0, grid, r, c)
            ids.append(7)  # newline: inside the grid, but not a cell
            add(1 if grid < 2 else 2, 0, grid, -1, -1)
    return np.asarray(ids, np.int32), {k: np.asarray(v, np.int32) for k, v in arc.items()}


def build_run(uri: str, *, num_partitions: int = 3, partition_rows: int = 8,
              rows_per_shard: int = 4, chunk_rows: int = 1, seq_len: int = 16,
              hidden: int = 8, hooks: tuple[str, ...] = DEFAULT_HOOKS,
              dtype: str = "float32", committed: tuple[int, ...] | None = None,
              arc_every: int = 3, seed: int = 0, codec: str = "zstd",
              random_values: bool = False, packing: str = "segmented",
              chunk_tokens: int = 0, last_partition_rows: int | None = None) -> RunTruth:
    """Writes a run at `uri` (a local path, memory://name or gs://...). `committed`:
    partitions that get a marker (default: all but the last). Activations of uncommitted
    partitions are written too (they must be ignored).
    random_values: store N(0, 1) noise instead of the token encoding (benchmarks: realistic
    compression; `RunTruth.value` is then meaningless).
    packing: "segmented" or "concat" (see `_pack`).
    chunk_tokens: LayoutSpec.chunk_tokens (tokens per inner activation chunk; 0: a row).
    last_partition_rows: rows of the last partition (default partition_rows), as prepare
      makes a short last partition when the rows do not fill it.
    Arrays are opened in the process-wide tensorstore context (schemas.ts_context), the
    only one in which a memory:// run exists."""
    last_rows = partition_rows if last_partition_rows is None else last_partition_rows
    total_rows = (num_partitions - 1) * partition_rows + last_rows
    if committed is None:
        committed = tuple(range(num_partitions - 1))
    rng = np.random.default_rng(seed)
    arrays, docs = _pack(rng, total_rows, seq_len, arc_every, packing)
    layout_dict = {"rows_per_shard": rows_per_shard, "partition_rows": partition_rows,
                   "chunk_rows": chunk_rows, "codec": codec}
    if chunk_tokens:
        layout_dict["chunk_tokens"] = chunk_tokens
    spec = runspec_lib.RunSpec.from_dict({
        "model": {"path": "/nonexistent/model"},
        "tokenizer": {"path": "/nonexistent/tokenizer"},
        "sources": [{"kind": "text", "paths": ["synthetic.jsonl"]}],
        "packing": {"mode": packing, "seq_len": seq_len},
        "capture": {"hooks": ",".join(hooks), "dtype": dtype},
        "layout": layout_dict,
    })
    store = store_lib.open_store(uri)
    store.write_json(runspec_lib.RUN_SPEC_KEY, spec.to_json_obj())
    valid = arrays["segment_ids"] > 0
    partitions = []
    for p in range(num_partitions):
        lo, hi = p * partition_rows, min((p + 1) * partition_rows, total_rows)
        starts = [d for d in docs if lo <= d["first_row"] < hi]
        partitions.append(manifest_lib.Partition(p, lo, hi - lo,
                                                 int(valid[lo:hi].sum()), len(starts)))
        store.write(layout.docs_key(p),
                    "".join(json.dumps(d, sort_keys=True) + "\n" for d in starts).encode())
    manifest = manifest_lib.Manifest(
        fingerprint=spec.fingerprint, seq_len=seq_len, total_rows=total_rows,
        total_tokens=int(valid.sum()), partitions=tuple(partitions),
        sources={"text0": manifest_lib.SourceCounts(len(docs), len(docs), 0)},
        vocab_size=1000, arc_tasks=ARC_TASKS, special_token_ids=SPECIAL_IDS,
        bos_id=BOS_ID, eos_id=EOS_ID)
    manifest_lib.write_manifest(store, manifest)

    loc = store.location
    for name in layout.ALL_TOKEN_ARRAYS:
        arr = ts_context.open_array(layout.token_array(name, total_rows, seq_len, spec.layout)
                                    .spec(loc, create=True))
        arr.write(arrays[name]).result()
    rows = np.arange(total_rows)[:, None] * np.ones(seq_len, np.int64)
    cols = np.ones(total_rows, np.int64)[:, None] * np.arange(seq_len)
    stored, written, written_dtypes = {}, {}, {}
    for k, hook in enumerate(hooks):
        if random_values:
            values = rng.standard_normal((total_rows, seq_len, hidden), np.float32)
        else:
            values = encode(k, rows, cols, seq_len, hidden)
        values[~valid] = PAD_VALUE
        if quantised.is_quantised(dtype):  # float8 values and their per-token scales
            values, scale = quantised.quantise(values, dtype)
            stored[hook] = quantised.dequantise(values, scale)
            parts = {hook: (values, quantised.stored_dtype(dtype)),
                     quantised.scale_array(hook): (scale, quantised.SCALE_DTYPE)}
        else:
            values = values.astype(np_dtype(dtype))
            stored[hook] = values
            parts = {hook: (values, dtype)}
        for name, (data, data_type) in parts.items():
            written[name], written_dtypes[name] = data, data_type
            arr = ts_context.open_array(layout.activation_array(
                name, total_rows, seq_len, data.shape[-1], data_type, spec.layout
            ).spec(loc, create=True))
            arr.write(data).result()
    info = {"fingerprint": spec.fingerprint, "dtype": dtype, "hooks": {h: hidden for h in hooks}}
    if quantised.is_quantised(dtype):
        info["quantisation_version"] = quantised.FORMAT_VERSION
    store.write_json(layout.ACTIVATIONS_INFO_KEY, info)
    truth = RunTruth(uri=uri, seq_len=seq_len, hidden=hidden, hooks=tuple(hooks), dtype=dtype,
                     tokens=arrays, docs=docs, committed=(),
                     partition_rows=partition_rows, num_partitions=num_partitions,
                     stored=stored, fingerprint=spec.fingerprint,
                     rows_per_shard=rows_per_shard, arrays=written,
                     array_dtypes=written_dtypes)
    for p in committed:
        commit_partition(truth, p)
    return truth


def commit_partition(truth: RunTruth, p: int) -> bool:
    """Writes partition p's commit marker (its data was written by build_run), as a worker
    commits it: what a test does to make a partition of a live run commit."""
    total_rows = truth.tokens["segment_ids"].shape[0]
    lo, hi = p * truth.partition_rows, min((p + 1) * truth.partition_rows, total_rows)
    arrays = truth.arrays or {h: truth.stored[h] for h in truth.hooks}
    dtypes = truth.array_dtypes or {h: truth.dtype for h in truth.hooks}
    checksums = {h: [commit_lib.checksum(a[r:r + truth.rows_per_shard].tobytes())
                     for r in range(lo, hi, truth.rows_per_shard)] for h, a in arrays.items()}
    done = commit_lib.commit(store_lib.open_store(truth.uri), commit_lib.CommitMarker(
        partition=p, fingerprint=truth.fingerprint, row_start=lo, row_count=hi - lo,
        tokens=int((truth.tokens["segment_ids"][lo:hi] > 0).sum()),
        block_rows=truth.rows_per_shard, checksums=checksums,
        dtypes=dtypes, attempt="test", hosts=("localhost",),
        timings_s={}, code_version="test", created_at=time.time()))
    if done:
        truth.committed = tuple(sorted(set(truth.committed) | {p}))
    return done


@pytest.fixture
def reader_run(tmp_path) -> RunTruth:
    """A float32 local run: 3 partitions x 8 rows x 16 tokens, partitions 0 and 1 committed."""
    return build_run(str(tmp_path / "run"))

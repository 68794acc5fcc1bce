"""Contract-exact prepared runs made directly (no Beam), for fast worker and ops tests.

Rows hold segmented documents of random tokens with padding at row ends, written through
`schemas.layout` exactly as prepare writes them. End-to-end tests use the real pipeline;
these exercise the workers against many layouts quickly.
"""

from __future__ import annotations

import numpy as np

from actx.schemas import layout, manifest, runspec, store, ts_context, uri


def segmented_rows(n_rows: int, seq_len: int, vocab: int, seed: int = 0):
    """(input_ids, segment_ids, positions, doc_index) int32 [n_rows, seq_len]."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((n_rows, seq_len), np.int32)
    seg = np.zeros_like(ids)
    pos = np.zeros_like(ids)
    doc = np.full_like(ids, -1)
    doc_no = 0
    for r in range(n_rows):
        col, s = 0, 1
        fill = int(rng.integers(seq_len // 2, seq_len + 1))
        while col < fill:
            n = int(min(fill - col, rng.integers(2, max(3, seq_len // 2))))
            ids[r, col:col + n] = rng.integers(1, vocab, n)
            seg[r, col:col + n] = s
            pos[r, col:col + n] = np.arange(n)
            doc[r, col:col + n] = doc_no
            col, s, doc_no = col + n, s + 1, doc_no + 1
    return ids, seg, pos, doc


def write_token_run(run_uri: str, model_path: str, n_rows: int = 24, seq_len: int = 16,
                    vocab: int = 512, hooks: str = "layers.*.resid_post",
                    dtype: str = "float32", model_dtype: str = "float32",
                    rows_per_shard: int = 4, partition_rows: int = 8, codec: str = "zstd",
                    seed: int = 0, overflow: str = "continue") -> runspec.RunSpec:
    spec = runspec.RunSpec.from_dict({
        "name": "test",
        "model": {"path": model_path, "dtype": model_dtype},
        "tokenizer": {"path": "synthetic"},
        "sources": [{"kind": "text", "paths": ["synthetic.jsonl"]}],
        "packing": {"mode": "segmented", "seq_len": seq_len, "overflow": overflow},
        "capture": {"hooks": hooks, "dtype": dtype},
        "layout": {"rows_per_shard": rows_per_shard, "partition_rows": partition_rows,
                   "chunk_rows": 1, "codec": codec},
    })
    loc = uri.parse(run_uri)
    arrays = dict(zip(("input_ids", "segment_ids", "positions", "doc_index"),
                      segmented_rows(n_rows, seq_len, vocab, seed)))
    # Every document fits its row: each token saw its whole document.
    arrays["context_start"] = np.where(arrays["segment_ids"] > 0, 0, -1).astype(np.int32)
    for name in layout.ALL_TOKEN_ARRAYS:
        data = arrays.get(name, np.full((n_rows, seq_len), -1, np.int32))
        arr = ts_context.open_array(
            layout.token_array(name, n_rows, seq_len, spec.layout).spec(loc, create=True))
        arr.write(data).result()
    seg = arrays["segment_ids"]
    parts = []
    for pid, start in enumerate(range(0, n_rows, partition_rows)):
        stop = min(n_rows, start + partition_rows)
        docs = arrays["doc_index"][start:stop]
        parts.append(manifest.Partition(id=pid, row_start=start, row_count=stop - start,
                                        tokens=int((seg[start:stop] > 0).sum()),
                                        full_context_tokens=int((seg[start:stop] > 0).sum()),
                                        docs=int(len(np.unique(docs[docs >= 0])))))
    n_docs = int(arrays["doc_index"].max()) + 1
    m = manifest.Manifest(
        fingerprint=spec.fingerprint, seq_len=seq_len, total_rows=n_rows,
        total_tokens=int((seg > 0).sum()), partitions=tuple(parts),
        sources={spec.source_name(0): manifest.SourceCounts(n_docs, n_docs, 0)},
        vocab_size=vocab)
    s = store.open_store(loc)
    manifest.write_manifest(s, m)
    s.write_json(runspec.RUN_SPEC_KEY, spec.to_json_obj())
    return spec


def read_tokens(run_uri: str, name: str) -> np.ndarray:
    loc = uri.parse(run_uri)
    arr = ts_context.open_array({"driver": "zarr3",
                                 "kvstore": loc.join(layout.token_array_key(name)).kvstore()})
    return arr.read().result()


def read_activation(run_uri: str, hook: str) -> np.ndarray:
    loc = uri.parse(run_uri)
    arr = ts_context.open_array({"driver": "zarr3",
                                 "kvstore": loc.join(layout.activation_array_key(hook)).kvstore()})
    return arr.read().result()


# Documents of 1, 2, 5 and 12 rows (at seq_len 16) among short ones; with partitions of 16
# rows and shards of 4 the long ones cross shards, host slices and partitions.
LONG_DOC_LENGTHS = (5, 16, 3, 80, 7, 32, 2, 192, 9, 11, 40, 4, 100, 6, 27, 1, 60)


def write_long_document_run(run_uri: str, model_path: str, mode: str = "segmented",
                            seq_len: int = 16, max_context: int = 48,
                            lengths=LONG_DOC_LENGTHS, hooks: str = "layers.*.resid_post",
                            rows_per_shard: int = 4, partition_rows: int = 16,
                            vocab: int = 512, seed: int = 0, overflow: str = "continue",
                            model_dtype: str = "float32", store_dtype: str = "float32",
                            codec: str = "zstd"):
    """A run packed by the real packer (pipeline.pack) from random documents of `lengths`
    tokens. Returns (spec, documents as int32 arrays)."""
    from actx.pipeline import pack, write_store

    spec = runspec.RunSpec.from_dict({
        "name": "long",
        "model": {"path": model_path, "dtype": model_dtype},
        "tokenizer": {"path": "synthetic"},
        "sources": [{"kind": "text", "paths": ["synthetic.jsonl"]}],
        "packing": {"mode": mode, "seq_len": seq_len, "max_context": max_context,
                    "overflow": overflow},
        "capture": {"hooks": hooks, "dtype": store_dtype},
        "layout": {"rows_per_shard": rows_per_shard, "partition_rows": partition_rows,
                   "chunk_rows": 1, "codec": codec},
    })
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, vocab, n).astype(np.int32) for n in lengths]
    plan = pack.plan_pack([len(d) for d in docs], spec.packing)
    n_rows = plan.total_rows
    arrays = {name: np.full((n_rows, seq_len), layout.TOKEN_FILL.get(name, -1), np.int32)
              for name in layout.ALL_TOKEN_ARRAYS}
    for d, ids in enumerate(docs):
        pack.fill_rows(arrays, 0, plan.pieces[d], ids[:plan.stored_tokens[d]], d,
                       packing=spec.packing)
    loc = uri.parse(run_uri)
    for name in layout.ALL_TOKEN_ARRAYS:
        arr = ts_context.open_array(
            layout.token_array(name, n_rows, seq_len, spec.layout).spec(loc, create=True))
        arr.write(arrays[name]).result()
    seg, ctx = arrays["segment_ids"], arrays["context_start"]
    parts = []
    for pid, start in enumerate(range(0, n_rows, partition_rows)):
        stop = min(n_rows, start + partition_rows)
        rows = slice(start, stop)
        starts = {p[0].row for p in plan.pieces if start <= p[0].row < stop}
        parts.append(manifest.Partition(
            id=pid, row_start=start, row_count=stop - start,
            tokens=int((seg[rows] > 0).sum()),
            docs=sum(1 for p in plan.pieces if start <= p[0].row < stop) if starts else 0,
            full_context_tokens=int(((ctx[rows] == 0) & (seg[rows] > 0)).sum()),
            **write_store.doc_runs(seg[rows, 0], arrays["positions"][rows, 0], seq_len)))
    m = manifest.Manifest(
        fingerprint=spec.fingerprint, seq_len=seq_len, total_rows=n_rows,
        total_tokens=int((seg > 0).sum()), partitions=tuple(parts),
        sources={spec.source_name(0): manifest.SourceCounts(len(docs), len(docs), 0)},
        vocab_size=vocab)
    s = store.open_store(loc)
    manifest.write_manifest(s, m)
    s.write_json(runspec.RUN_SPEC_KEY, spec.to_json_obj())
    return spec, docs

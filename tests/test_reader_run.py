"""Opening runs, random access, errors, and the arrays as zarr-python sees them."""

import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from actx import reader
from tests import reader_fixtures as rf


def test_describe_lists_hooks_shapes_dtypes_and_commits(reader_run):
    run = reader.open_run(reader_run.uri)
    info = run.describe()
    assert set(info["hooks"]) == set(rf.DEFAULT_HOOKS)
    # A run that records no architecture is of an RMSNorm family (schemas.hook_aliases).
    assert info["hooks"]["embed"] == {"shape": [24, 16, 8], "dtype": "float32",
                                     "transformer_lens": "hook_embed"}
    assert info["committed"] == [0, 1] and info["uncommitted"] == [2]
    assert run.hook("embed").partitions == (0, 1)


def test_rows_and_tokens_return_the_stored_values(reader_run):
    run = reader.open_run(reader_run.uri)
    rows = run.rows("embed", 3, 6)
    r, c = np.meshgrid(np.arange(3, 6), np.arange(16), indexing="ij")
    valid = reader_run.tokens["segment_ids"][3:6] > 0
    np.testing.assert_array_equal(rows[valid], reader_run.value("embed", r[valid], c[valid]))
    toks = run.tokens("layers.0.resid_post", 9, 2, 7)
    np.testing.assert_array_equal(toks, reader_run.value("layers.0.resid_post",
                                                         np.full(5, 9), np.arange(2, 7)))
    np.testing.assert_array_equal(run.token_rows("input_ids", 0, 2),
                                  reader_run.tokens["input_ids"][:2])


def test_errors_name_the_problem(reader_run, tmp_path):
    run = reader.open_run(reader_run.uri)
    with pytest.raises(reader.UnknownHookError, match="available: embed, layers.0.resid_post"):
        run.rows("layers.9.resid_post", 0, 1)
    with pytest.raises(reader.UncommittedPartitionError, match=r"partition 2 .*actx rerun"):
        run.rows("embed", 15, 17)
    with pytest.raises(reader.UncommittedPartitionError):
        run.batches("embed", 4, partitions=[1, 2])
    with pytest.raises(reader.NotARunError, match="not an actx run"):
        reader.open_run(tmp_path / "nothing")


def test_document_follows_overflow_across_rows(reader_run):
    run = reader.open_run(reader_run.uri)
    long_docs = [d for d in reader_run.docs
                 if d["first_col"] + d["n_tokens"] > 16 and d["first_row"] < 15]
    doc = long_docs[0]
    sel = run.document(doc["doc_id"], ["embed"])
    want_r, want_c = np.nonzero(reader_run.tokens["doc_index"] == doc["doc_index"])
    np.testing.assert_array_equal(sel.rows, want_r)
    np.testing.assert_array_equal(sel.cols, want_c)
    assert len(np.unique(sel.rows)) > 1 and len(sel) == doc["n_tokens"]
    np.testing.assert_array_equal(sel.input_ids, reader_run.tokens["input_ids"][want_r, want_c])
    np.testing.assert_array_equal(sel.acts["embed"], reader_run.value("embed", want_r, want_c))
    np.testing.assert_array_equal(run.document(doc["doc_index"]).rows, want_r)
    late = [d for d in reader_run.docs if d["first_row"] >= 16][0]
    with pytest.raises(KeyError, match="committed"):
        run.document(late["doc_index"])


def test_gcs_run_reads_like_local(gcs_bucket):
    truth = rf.build_run(f"{gcs_bucket}/runs/r1", num_partitions=2, committed=(0,))
    run = reader.open_run(f"{gcs_bucket}/runs/r1")
    assert run.committed == (0,)
    batches = list(run.batches("embed", 16, drop_last=False))
    got = np.concatenate([b.rows * 16 + b.cols for b in batches])
    assert sorted(got) == sorted(np.flatnonzero(truth.committed_mask()))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_zarr_python_reads_the_same_values(tmp_path, dtype):
    import zarr

    from actx.reader import zarr_compat

    truth = rf.build_run(str(tmp_path / "run"), dtype=dtype, num_partitions=2)
    if dtype == "bfloat16":  # zarr-python 3.1 has no bfloat16 of its own
        zarr_compat.register_bfloat16()
    run = reader.open_run(truth.uri)
    for hook in truth.hooks:
        z = zarr.open_array(str(tmp_path / "run" / "activations" / hook), mode="r")
        assert z.shape == run.hook(hook).shape and str(z.dtype) == dtype
        np.testing.assert_array_equal(np.asarray(z[0:8]), run.rows(hook, 0, 8))
        b = next(iter(run.batches(hook, 5, seed=3)))
        np.testing.assert_array_equal(np.asarray(z[:])[b.rows, b.cols], b.acts[hook])


def test_import_needs_neither_jax_nor_beam(reader_run):
    code = (
        "import sys, reader\n"
        f"run = reader.open_run({reader_run.uri!r})\n"
        "b = next(iter(run.batches('embed', 8)))\n"
        "assert b.acts['embed'].shape == (8, 8)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'apache_beam')]\n"
        "assert not bad, bad\n"
    )
    env = {k: v for k, v in os.environ.items()}
    subprocess.run([sys.executable, "-c", code], check=True, env=env,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_memory_run_reads_like_local():
    # tensorstore keeps one memory store per Context: the reader must open arrays in the
    # process-wide one (schemas.ts_context) that the writer used.
    uri = f"memory://reader-test-{uuid.uuid4().hex}/run"
    truth = rf.build_run(uri, num_partitions=2)
    run = reader.open_run(uri)
    assert run.committed == (0,) and set(run.hooks) == set(rf.DEFAULT_HOOKS)
    b = next(iter(run.batches(["embed", "layers.0.resid_post"], 8, seed=1)))
    for hook in truth.hooks:
        np.testing.assert_array_equal(b.acts[hook], truth.value(hook, b.rows, b.cols))
    r, c = np.nonzero(truth.tokens["segment_ids"][:2] > 0)
    np.testing.assert_array_equal(run.rows("embed", 0, 2)[r, c], truth.value("embed", r, c))
    assert run.compute_stats(["embed"])["embed"].count == truth.committed_mask().sum()
    assert run.stats("embed").count == truth.committed_mask().sum()


@pytest.mark.parametrize("chunk_tokens", [4, 16, 32])
def test_inner_chunks_of_part_of_a_row_read_the_same(tmp_path, chunk_tokens):
    # chunk_tokens splits a row into several inner chunks (32 > seq_len: one per row);
    # nothing in the reader may assume a chunk spans the whole row.
    truth = rf.build_run(str(tmp_path / "run"), chunk_tokens=chunk_tokens, chunk_rows=2)
    run = reader.open_run(truth.uri)
    assert run.spec.layout.chunk_tokens == chunk_tokens
    for in_memory in (False, True):
        batches = list(run.batches("embed", 7, seed=2, drop_last=False, in_memory=in_memory))
        flat = np.concatenate([b.rows * 16 + b.cols for b in batches])
        assert np.array_equal(np.sort(flat), np.flatnonzero(truth.committed_mask()))
        for b in batches:
            np.testing.assert_array_equal(b.acts["embed"], truth.value("embed", b.rows, b.cols))
    toks = run.tokens("embed", 9, 3, 14)
    np.testing.assert_array_equal(toks, truth.value("embed", np.full(11, 9), np.arange(3, 14)))
    stats = run.compute_stats(["embed"], write=False)["embed"]
    assert stats.count == truth.committed_mask().sum()

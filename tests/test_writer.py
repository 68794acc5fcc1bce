"""The shard writer: whole-shard objects, checksums of what is stored, slice bounds."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

from actx.schemas import commit, runspec, uri
from actx.workers.write import block_copy, writer

LAYOUT = runspec.LayoutSpec(rows_per_shard=4, partition_rows=8, chunk_rows=2, codec="zstd")


def _arrays(tmp_path, dtype="bfloat16"):
    return writer.ActivationArrays(uri.parse(str(tmp_path / "run")), {"a": 8, "b": 8},
                                   total_rows=16, seq_len=3, dtype=dtype, layout=LAYOUT)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_rows_in_uneven_batches_become_whole_shards(tmp_path, dtype):
    arrays = _arrays(tmp_path, dtype)
    pool = writer.WriterPool(threads=2, max_pending_bytes=1000)
    part = writer.PartitionWriter(arrays, (8, 15), pool)  # a short last slice: 7 rows
    rng = np.random.default_rng(0)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    data = {k: rng.normal(size=(7, 3, 8)).astype(np_dtype) for k in ("a", "b")}
    for lo, hi in ((0, 3), (3, 5), (5, 7)):  # batches that straddle shard boundaries
        part.add(8 + lo, {k: v[lo:hi] for k, v in data.items()})
    sums = part.finish()
    pool.shutdown()
    for hook in ("a", "b"):
        stored = ts.open({"driver": "zarr3", "kvstore": {
            "driver": "file", "path": str(tmp_path / "run" / "activations" / hook) + "/"}}
        ).result()
        np.testing.assert_array_equal(stored[8:15].read().result(), data[hook])
        expected = [commit.checksum(np.ascontiguousarray(data[hook][i:i + 4]).tobytes())
                    for i in (0, 4)]
        assert sums[hook] == expected
    shard_files = sorted(p.name for p in (tmp_path / "run/activations/a/c").iterdir())
    assert shard_files == ["2", "3"]  # shards of rows 8-11 and 12-15 only


def test_rows_outside_the_slice_are_refused(tmp_path):
    part = writer.PartitionWriter(_arrays(tmp_path), (0, 4), writer.WriterPool(1, 1 << 20))
    with pytest.raises(ValueError, match="outside this host's slice"):
        part.add(2, {"a": np.zeros((3, 3, 8)), "b": np.zeros((3, 3, 8))})


def test_an_unfinished_block_cannot_be_committed(tmp_path):
    part = writer.PartitionWriter(_arrays(tmp_path), (0, 8), writer.WriterPool(1, 1 << 20))
    part.add(0, {"a": np.zeros((5, 3, 8)), "b": np.zeros((5, 3, 8))})
    with pytest.raises(RuntimeError, match="never completed"):
        part.finish()


def test_blocks_of_a_partition_taken_over_are_left_unwritten_and_it_cannot_be_committed(
        tmp_path):
    """skip_if (a partition another attempt took while this process was silent): the
    blocks asked after it says so are not written, and finish() raises TakenOver, so no
    marker is made over them; the writer says it writes no more."""
    taken = []
    pool = writer.WriterPool(1, 1 << 20)
    part = writer.PartitionWriter(_arrays(tmp_path), (0, 8), pool,
                                  skip_if=lambda: bool(taken))
    part.add(0, {"a": np.ones((4, 3, 8)), "b": np.ones((4, 3, 8))})
    part._futures[0][1].result()  # the first block written before the silence
    taken.append(True)
    part.add(4, {"a": np.ones((4, 3, 8)), "b": np.ones((4, 3, 8))})
    with pytest.raises(writer.TakenOver, match="1 block"):
        part.finish()
    pool.shutdown()
    assert part.finished
    assert sorted(p.name for p in (tmp_path / "run/activations/a/c").iterdir()) == ["0"]
    # Taken once every block was written: still not to be committed here.
    taken.clear()
    pool = writer.WriterPool(1, 1 << 20)
    part = writer.PartitionWriter(_arrays(tmp_path), (8, 16), pool,
                                  skip_if=lambda: bool(taken))
    part.add(8, {"a": np.ones((8, 3, 8)), "b": np.ones((8, 3, 8))})
    [future.result() for _, future in part._futures]
    taken.append(True)
    with pytest.raises(writer.TakenOver, match="taken once its blocks were written"):
        part.finish()
    pool.shutdown()


def test_pool_bounds_bytes_in_flight():
    import threading
    import time

    pool = writer.WriterPool(threads=4, max_pending_bytes=100)
    in_flight, peak, lock = [0], [0], threading.Lock()

    def job(n):
        with lock:
            in_flight[0] += n
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(0.02)
        with lock:
            in_flight[0] -= n

    futures = [pool.submit(job, 40, nbytes=40) for _ in range(10)]
    for f in futures:
        f.result()
    pool.shutdown()
    assert peak[0] <= 80  # two 40-byte blocks fit under 100, a third never joins them
    assert pool.bytes_written == 400


@pytest.mark.parametrize("codec", ["none", "zstd", "blosc"])
def test_every_codec_round_trips_and_zarr_python_agrees(tmp_path, codec):
    import zarr

    layout = runspec.LayoutSpec(rows_per_shard=4, partition_rows=8, chunk_rows=2,
                                chunk_tokens=2, codec=codec)
    arrays = writer.ActivationArrays(uri.parse(str(tmp_path / "run")), {"h": 8}, total_rows=8,
                                     seq_len=4, dtype="float32", layout=layout)
    pool = writer.WriterPool(1, 1 << 20)
    part = writer.PartitionWriter(arrays, (0, 8), pool)
    data = np.random.default_rng(1).normal(size=(8, 4, 8)).astype(np.float32)
    part.add(0, {"h": data})
    part.finish()
    pool.shutdown()
    stored = zarr.open_array(str(tmp_path / "run" / "activations" / "h"), mode="r")
    np.testing.assert_array_equal(stored[:], data)
    meta = json.loads((tmp_path / "run" / "activations" / "h" / "zarr.json").read_text())
    inner = [c["name"] for c in meta["codecs"][0]["configuration"]["codecs"]]
    assert inner == {"none": ["bytes"], "zstd": ["bytes", "zstd"],
                     "blosc": ["bytes", "blosc"]}[codec]


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_scattered_slots_and_whole_block_pieces_store_each_row_in_its_place(
        tmp_path, monkeypatch, copy_threads):
    """Steps whose slots hold rows out of order, some not written, in per-device pieces of
    2 slots, and one piece that is a whole block: every row lands where its row number says,
    copied on one thread or cut into pieces over three (workers.write.block_copy)."""
    monkeypatch.setattr(block_copy, "MIN_PARALLEL_BYTES", 0)
    monkeypatch.setattr(block_copy, "MIN_PIECE_BYTES", 16)
    arrays = _arrays(tmp_path, "float32")
    pool = writer.WriterPool(threads=2, max_pending_bytes=1 << 20, copy_threads=copy_threads)
    part = writer.PartitionWriter(arrays, (4, 16), pool)  # blocks at rows 4, 8, 12
    rng = np.random.default_rng(1)
    data = {k: rng.normal(size=(16, 3, 8)).astype(np.float32) for k in ("a", "b")}
    steps = [  # (rows per slot, written per slot, slots per piece)
        ((9, 10, 4, 5, 6, 13, 7, 4), (True, True, True, True, True, True, True, False), 2),
        ((12, 8, 11, 15, 14, 8, 8, 8), (True, True, True, True, True, False, False, False), 2),
        ((4, 4, 4, 4), (False,) * 4, 4),  # nothing written (padding)
    ]
    for rows, write, per_piece in steps:
        pieces = {k: [(o, v[list(rows[o:o + per_piece])])
                      for o in range(0, len(rows), per_piece)] for k, v in data.items()}
        part.add_slots(rows, write, pieces)
    sums = part.finish()
    pool.shutdown()
    for hook in ("a", "b"):
        stored = ts.open({"driver": "zarr3", "kvstore": {
            "driver": "file", "path": str(tmp_path / "run" / "activations" / hook) + "/"}}
        ).result()
        np.testing.assert_array_equal(stored[4:16].read().result(), data[hook][4:16])
        assert sums[hook] == [commit.checksum(np.ascontiguousarray(data[hook][i:i + 4]).tobytes())
                              for i in (4, 8, 12)]


def test_a_device_shard_that_is_a_whole_block_is_stored_as_it_is(tmp_path):
    arrays = _arrays(tmp_path, "float32")
    pool = writer.WriterPool(threads=1, max_pending_bytes=1 << 20)
    part = writer.PartitionWriter(arrays, (0, 8), pool)
    values = {k: np.arange(8 * 3 * 8, dtype=np.float32).reshape(8, 3, 8) + i
              for i, k in enumerate(("a", "b"))}
    part.add_slots(tuple(range(8)), (True,) * 8,
                   {k: [(0, v[:4]), (4, v[4:])] for k, v in values.items()})
    part.finish()
    pool.shutdown()
    for hook, v in values.items():
        stored = ts.open({"driver": "zarr3", "kvstore": {
            "driver": "file", "path": str(tmp_path / "run" / "activations" / hook) + "/"}}
        ).result()
        np.testing.assert_array_equal(stored[0:8].read().result(), v)


def test_written_blocks_buffers_are_filled_again_with_the_next_rows(tmp_path):
    """Blocks assembled from scattered rows take the buffers of blocks already written
    (here the partition before's); every stored row is still the row given, none is
    left over from the buffer's last block."""
    arrays = _arrays(tmp_path, "float32")
    pool = writer.WriterPool(threads=1, max_pending_bytes=1 << 20)
    rng = np.random.default_rng(2)
    data = {k: rng.normal(size=(16, 3, 8)).astype(np.float32) for k in ("a", "b")}
    for lo in (0, 8):  # two partitions of two blocks each, on one pool
        part = writer.PartitionWriter(arrays, (lo, lo + 8), pool)
        for rows in ((lo + 1, lo + 4), (lo + 0, lo + 5), (lo + 3, lo + 6),
                     (lo + 2, lo + 7)):  # each step's rows in two blocks: copied
            part.add_slots(rows, (True, True),
                           {k: [(0, v[list(rows)])] for k, v in data.items()})
        part.finish()
    pool.shutdown()
    assert pool.buffers.reused == 4  # the second partition's blocks refilled the first's
    for hook in ("a", "b"):
        stored = ts.open({"driver": "zarr3", "kvstore": {
            "driver": "file", "path": str(tmp_path / "run" / "activations" / hook) + "/"}}
        ).result()
        np.testing.assert_array_equal(stored[0:16].read().result(), data[hook])


def test_block_buffers_are_bounded_and_keyed_by_shape_and_dtype():
    buffers = writer.BlockBuffers(max_free_bytes=100)
    a = buffers.take((3, 4), np.float32)  # 48 bytes
    buffers.give(a)
    assert buffers.take((3, 4), np.float16) is not a  # another dtype: a fresh one
    assert buffers.take((4, 3), np.float32) is not a  # another shape
    assert buffers.take((3, 4), np.float32) is a
    buffers.give(a)
    buffers.give(np.empty((3, 4), np.float32))
    buffers.give(np.empty((3, 4), np.float32))  # past 100 bytes: dropped
    for _ in range(3):
        buffers.take((3, 4), np.float32)
    assert buffers.reused == 3  # a once before, then the two that were kept


@pytest.mark.parametrize("layout", ["contiguous", "strided source", "cast to bfloat16",
                                    "broadcast row"])
def test_block_copier_pieces_copy_every_element_once(monkeypatch, layout):
    """The copier's pieces, over four threads, give the bytes one np.copyto gives."""
    monkeypatch.setattr(block_copy, "MIN_PARALLEL_BYTES", 0)
    monkeypatch.setattr(block_copy, "MIN_PIECE_BYTES", 64)
    rng = np.random.default_rng(2)
    big = rng.normal(size=(6, 40, 16)).astype(np.float32)
    dtype = ml_dtypes.bfloat16 if layout == "cast to bfloat16" else np.float32
    src = {"contiguous": big, "strided source": big[:, ::2], "cast to bfloat16": big,
           "broadcast row": big[:1, :20]}[layout]
    shape = (6, 20, 16) if layout in ("strided source", "broadcast row") else big.shape
    want, got = np.zeros(shape, dtype), np.full(shape, 7, dtype)
    np.copyto(want, src)
    copier = block_copy.BlockCopier(threads=4)
    assert len(block_copy._pieces(got, src, 4 * 16 * 4)) > 1  # really cut
    copier.copy([(got[:3], src[:3] if src.shape[0] > 1 else src), (got[3:], src[3:]
                 if src.shape[0] > 1 else src)])
    copier.shutdown()
    np.testing.assert_array_equal(got, want)

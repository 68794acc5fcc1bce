"""The stream's mapped reads (reader.storage.mapped_hook, shard_files, mapped_region): a local hook
stored without a codec is copied straight from its shard files, with values equal to
zarr-python's read of the same arrays whoever wrote the shards (tensorstore or zarr-python,
inner chunks in any order, some not stored); every other layout, and every shard file
that is not exactly as expected, is decoded by tensorstore instead."""

import copy
import gc
import os
import time

import crc32c
import numpy as np
import pytest

from actx import reader
from actx.reader.streaming import gather as gather_lib
from actx.reader.storage import shard_files
from tests import reader_fixtures as rf

T = 16  # the fixtures' seq_len
MISSING = 2**64 - 1


def _run(path, **kwargs):
    """4 partitions of 8, 8, 8 and 4 rows; 0, 1 and 3 committed; shards of 4 rows; no
    codec; padding at row ends."""
    args = dict(num_partitions=4, partition_rows=8, last_partition_rows=4, rows_per_shard=4,
                committed=(0, 1, 3), codec="none")
    args.update(kwargs)
    return rf.build_run(str(path), **args)


def _stream(run, **kwargs):
    args = dict(buffer_tokens=6 * T, block_rows=2, seed=3, drop_last=False, epochs=2)
    args.update(kwargs)
    return run.stream(["embed", "layers.0.resid_post"], args.pop("batch_size", 7), **args)


def _zarr_read(truth, hook):
    """The whole hook array as zarr-python reads it (the independent reference)."""
    import zarr

    from actx.reader import zarr_compat

    zarr_compat.register_bfloat16()
    return np.asarray(zarr.open_array(os.path.join(truth.uri, "activations", hook),
                                      mode="r")[:])


def _check(truth, batches):
    """Every batch equals zarr-python's values at its tokens; every valid committed token
    comes once per epoch."""
    for hook in truth.hooks:
        z = _zarr_read(truth, hook)
        for b in batches:
            assert b.acts[hook].dtype == z.dtype
            np.testing.assert_array_equal(b.acts[hook], z[b.rows, b.cols])
    want = np.flatnonzero(truth.committed_mask())
    for epoch in {b.epoch for b in batches}:
        got = np.concatenate([b.rows * T + b.cols for b in batches if b.epoch == epoch])
        assert np.array_equal(np.sort(got), want)


def _shard_path(truth, hook, shard):
    return os.path.join(truth.uri, "activations", hook, "c", str(shard), "0", "0")


def _index(path, chunks):
    """(offset, nbytes) pairs of a shard file's index, parsed here with numpy alone."""
    data = open(path, "rb").read()
    body = data[-(16 * chunks + 4):-4]
    assert crc32c.crc32c(body) == int.from_bytes(data[-4:], "little")
    return np.frombuffer(body, "<u8").reshape(-1, 2)


@pytest.mark.parametrize("dtype,chunk_rows,chunk_tokens,block_rows", [
    ("bfloat16", 1, 0, 2),  # actx's default: inner chunks of one row
    ("float32", 2, 8, 2),  # chunks of 2 rows x 8 tokens, blocks inside one shard
    ("bfloat16", 2, 4, 8),  # blocks of 8 rows: two shards each
])
def test_mapped_values_equal_zarr_pythons_and_the_decoded_streams(tmp_path, monkeypatch, dtype,
                                                                   chunk_rows, chunk_tokens,
                                                                   block_rows):
    truth = _run(tmp_path / "run", dtype=dtype, chunk_rows=chunk_rows,
                 chunk_tokens=chunk_tokens)
    run = reader.open_run(truth.uri)
    buffer_tokens = max(6, 2 * block_rows) * T
    mapped = _stream(run, block_rows=block_rows, buffer_tokens=buffer_tokens)
    assert mapped.read_paths == {h: "mapped" for h in truth.hooks}
    batches = list(mapped)
    _check(truth, batches)
    for m in mapped._mapped.values():
        assert m.mapped_blocks > 0 and m.decoded_blocks == 0 and not m.refusals
    # The same order and values as when tensorstore decodes every block, and when read
    # in the caller's thread with the copies in tasks on 3 threads, or resumed mid-epoch.
    decoded = _stream(run, block_rows=block_rows, buffer_tokens=buffer_tokens,
                      map_shards=False)
    assert decoded.read_paths["embed"] == "decoded: map_shards=False"
    monkeypatch.setattr(gather_lib, "ROWS_PER_TASK", 2)
    inline = _stream(run, block_rows=block_rows, buffer_tokens=buffer_tokens, prefetch=0,
                     gather_threads=3)
    k = len(batches) // 2 + 1
    resumed = _stream(run, block_rows=block_rows, buffer_tokens=buffer_tokens,
                      resume=mapped.state(batches[k - 1]))
    for other, skip in ((decoded, 0), (inline, 0), (resumed, k)):
        for a, b in zip(batches[skip:], other, strict=True):
            assert np.array_equal(a.rows, b.rows) and np.array_equal(a.cols, b.cols)
            for hook in truth.hooks:
                assert a.acts[hook].tobytes() == b.acts[hook].tobytes()


def test_shards_written_by_zarr_python_in_morton_order_with_chunks_not_stored(tmp_path):
    import zarr

    truth = _run(tmp_path / "run", chunk_rows=2, chunk_tokens=8)
    # Rows of zeros (the fill value), valid tokens among them, so zarr-python stores
    # none of their inner chunks; it writes the others in Morton order, not C order.
    hook = "embed"
    z = zarr.open_array(os.path.join(truth.uri, "activations", hook), mode="r+")
    values = np.asarray(z[:])
    values[2:4, :8] = 0
    values[8:10] = 0
    z[:] = values
    # Index entries in C order of the [2 x 2] inner chunks (rows, tokens) of a shard.
    assert (_index(_shard_path(truth, hook, 0), chunks=4)[2] == MISSING).all()  # rows 2..3
    assert (_index(_shard_path(truth, hook, 2), chunks=4)[:2] == MISSING).all()  # 8..9
    offsets = _index(_shard_path(truth, hook, 1), chunks=4)[:, 0]
    assert not np.array_equal(offsets, np.sort(offsets))  # chunks stored not in C order
    run = reader.open_run(truth.uri)
    s = _stream(run)
    batches = list(s)
    _check(truth, batches)
    assert s._mapped[hook].decoded_blocks == 0
    got_zero = [b.acts[hook][b.rows // 2 == 4] for b in batches]  # rows 8..9
    assert sum(len(g) for g in got_zero) > 0 and all((g == 0).all() for g in got_zero)


def _rewrite_shard(path, chunks, shift):
    """The same shard with its inner chunks moved `shift` bytes on (a valid shard that
    zarr-python reads, but whose chunks start off a token's byte boundary)."""
    data = open(path, "rb").read()
    index = _index(path, chunks).copy()
    body = data[:-(16 * chunks + 4)]
    stored = index[:, 0] != MISSING
    index[stored, 0] += shift
    body_index = index.astype("<u8").tobytes()
    new = b"\0" * shift + body + body_index + crc32c.crc32c(body_index).to_bytes(4, "little")
    open(path, "wb").write(new)


def test_shard_files_that_cannot_be_mapped_are_decoded_by_tensorstore(tmp_path):
    truth = _run(tmp_path / "run", dtype="bfloat16", committed=(1, 3))
    _rewrite_shard(_shard_path(truth, "embed", 1), chunks=4, shift=2)  # rows 4..7
    # Rows 0..3 written as zeros: the store keeps them as no object (the fill value).
    truth.arrays["layers.0.resid_post"][0:4] = 0
    rf.commit_partition(truth, 0)
    os.remove(_shard_path(truth, "layers.0.resid_post", 0))
    run = reader.open_run(truth.uri)
    s = _stream(run, epochs=1)
    batches = list(s)
    _check(truth, batches)
    embed, resid = s._mapped["embed"], s._mapped["layers.0.resid_post"]
    assert embed.decoded_blocks == 2 and embed.mapped_blocks > 0  # 2 blocks per shard
    assert "multiple of 16 bytes" in embed.refusals[0]
    assert resid.decoded_blocks == 2 and "No such file" in resid.refusals[0]
    assert any((b.acts["layers.0.resid_post"][b.rows < 4] == 0).all() and (b.rows < 4).any()
               for b in batches)


@pytest.mark.parametrize("damage", ["index byte", "cut short"])
def test_a_damaged_shard_fails_the_stream_and_nothing_wrong_is_returned(tmp_path, damage):
    truth = _run(tmp_path / "run")
    run = reader.open_run(truth.uri)
    s = _stream(run, epochs=1)
    path = _shard_path(truth, "embed", 1)  # rows 4..7 of partition 0
    data = bytearray(open(path, "rb").read())
    if damage == "index byte":
        data[-10] ^= 0xFF  # the checksum no longer matches: tensorstore refuses it too
    else:
        data = data[:100]
    open(path, "wb").write(bytes(data))
    got = []
    with pytest.raises(reader.ReaderError, match=r"partitions \[0(, \d)*\] failed"):
        for b in s:
            got.append(b)
    assert "checksum" in s._mapped["embed"].refusals[0] or damage == "cut short"
    for b in got:
        np.testing.assert_array_equal(b.acts["embed"], truth.value("embed", b.rows, b.cols))


def test_other_layouts_are_decoded(tmp_path, monkeypatch):
    truth = _run(tmp_path / "run", codec="zstd")
    s = _stream(reader.open_run(truth.uri), epochs=1)
    assert s.read_paths["embed"].startswith("decoded: inner codecs")
    assert not s._mapped
    _check(truth, list(s))


def _metadata(tmp_path):
    truth = _run(tmp_path / "run", dtype="bfloat16", num_partitions=2, committed=(0,))
    run = reader.open_run(truth.uri)
    array = run.activation_array("embed")
    path = os.path.join(truth.uri, "activations", "embed", "zarr.json")
    return shard_files.read_metadata(path), array


def _sharding(m):
    return m["codecs"][0]["configuration"]


@pytest.mark.parametrize("change,reason", [
    (lambda m: _sharding(m)["codecs"].insert(
        0, {"name": "transpose", "configuration": {"order": [1, 0, 2]}}), "inner codecs"),
    (lambda m: _sharding(m)["codecs"].append({"name": "crc32c"}), "inner codecs"),
    (lambda m: _sharding(m)["codecs"][0]["configuration"].update(endian="big"),
     "inner codecs"),
    (lambda m: _sharding(m).update(index_location="start"), "index location"),
    (lambda m: _sharding(m)["index_codecs"].pop(), "index codecs"),
    (lambda m: _sharding(m).update(chunk_shape=[1, 16, 4]), "whole token vectors"),
    (lambda m: _sharding(m).update(chunk_shape=[3, 16, 8]), "whole token vectors"),
    (lambda m: m["codecs"].append({"name": "zstd", "configuration": {"level": 1}}),
     "one sharding_indexed"),
    (lambda m: m.update(fill_value="NaN"), "fill value"),
    (lambda m: m.update(fill_value=1.0), "tensorstore's"),
    (lambda m: m.update(data_type="float16"), "data type"),
    (lambda m: m.update(shape=[16, 16, 8]), "shape"),
    (lambda m: m["chunk_grid"]["configuration"].update(chunk_shape=[4, 8, 8]), "whole rows"),
    (lambda m: m.update(chunk_key_encoding={"name": "v2"}), "chunk key encoding"),
    (lambda m: m.update(storage_transformers=[{"name": "x"}]), "storage transformers"),
    (lambda m: m.update(must_understand={"x": 1}), "unknown metadata"),
])
def test_metadata_other_than_the_plain_layout_is_refused(tmp_path, change, reason):
    metadata, array = _metadata(tmp_path)
    args = (tuple(array.shape), np.dtype(array.dtype.numpy_dtype), array.fill_value)
    plain = shard_files.plain_shards(metadata, *args)  # as written: accepted
    assert (plain.shard_rows, plain.chunk_rows, plain.chunk_tokens) == (4, 1, 16)
    changed = copy.deepcopy(metadata)
    change(changed)
    with pytest.raises(shard_files.Refused, match=reason):
        shard_files.plain_shards(changed, *args)


def _mapped_files(directory):
    with open("/proc/self/maps") as f:
        return [line for line in f if directory in line]


def test_batches_outlive_the_mappings_and_every_mapping_is_released(tmp_path):
    truth = _run(tmp_path / "run")
    run = reader.open_run(truth.uri)
    directory = os.path.join(truth.uri, "activations")
    with _stream(run, epochs=3) as s:
        batches = list(s)
    del s
    gc.collect()
    deadline = time.monotonic() + 10
    while _mapped_files(directory) and time.monotonic() < deadline:
        time.sleep(0.05)  # unmapping happens on the pager thread
    assert not _mapped_files(directory)
    for b in batches:  # copies: still readable and right
        np.testing.assert_array_equal(b.acts["embed"], truth.value("embed", b.rows, b.cols))


def test_a_file_system_that_cannot_map_files_is_decoded_from_then_on(tmp_path, monkeypatch):
    import errno

    from actx.reader.storage import mapped_region

    def cannot_map(self, i, fd):  # as mmap fails on a file system without it
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(mapped_region.Region, "map_file", cannot_map)
    truth = _run(tmp_path / "run")
    s = _stream(reader.open_run(truth.uri))
    batches = list(s)
    _check(truth, batches)
    for m in s._mapped.values():
        assert m.mapped_blocks == 0 and m.decoded_blocks > 0
        assert m.disabled.startswith("mapping failed") and len(m.refusals) == 1


def test_a_stream_mixes_mapped_and_decoded_hooks(tmp_path):
    # One hook rewritten with its shard index at the start of each file (valid zarr, not
    # the layout mapped here): that hook is decoded, the other still mapped.
    import tensorstore as ts

    truth = _run(tmp_path / "run", dtype="bfloat16")
    hook = "layers.0.resid_post"
    run = reader.open_run(truth.uri)
    values = run.activation_array(hook).read().result()
    spec = run.activation_array(hook).spec().to_json()
    metadata = spec["metadata"]
    metadata["codecs"][0]["configuration"]["index_location"] = "start"
    ts.open({"driver": "zarr3", "kvstore": spec["kvstore"], "metadata": metadata,
             "create": True, "delete_existing": True}).result().write(values).result()
    s = _stream(reader.open_run(truth.uri))
    assert s.read_paths["embed"] == "mapped"
    assert s.read_paths[hook] == "decoded: index location 'start'"
    _check(truth, list(s))

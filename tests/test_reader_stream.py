"""The streaming shuffle (run.stream): every token once per epoch, disjoint processes,
seeded and resumable order, values as zarr-python reads them, gs:// runs, formats."""

import json
import os
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest

from actx import reader
from actx.reader.streaming import gather as gather_lib
from actx.reader.streaming import mixing
from actx.reader.streaming.state import StreamState
from tests import reader_fixtures as rf

T = 16  # the fixtures' seq_len


def _uneven_run(path, **kwargs):
    """4 partitions of 8, 8, 8 and 4 rows; 0, 1 and 3 committed (2 is written, not
    committed); shards of 4 rows, so blocks of 2 rows; padding at row ends."""
    return rf.build_run(str(path), num_partitions=4, partition_rows=8, last_partition_rows=4,
                        rows_per_shard=4, committed=(0, 1, 3), **kwargs)


def _flat(batches):
    return np.concatenate([np.asarray(b.rows) * T + np.asarray(b.cols) for b in batches])


def _stream(run, **kwargs):
    args = dict(buffer_tokens=6 * T, block_rows=2, seed=3)
    args.update(kwargs)
    return run.stream(["embed", "layers.0.resid_post"], args.pop("batch_size", 7), **args)


@pytest.mark.parametrize("process_count,codec", [(1, "zstd"), (2, "zstd"), (3, "zstd"),
                                                 (3, "none")])  # "none": mapped files
def test_every_valid_committed_token_once_per_epoch_across_processes(tmp_path, process_count,
                                                                     codec, monkeypatch):
    monkeypatch.setattr(gather_lib, "ROWS_PER_TASK", 2)  # split even 7-token batches
    monkeypatch.setattr(gather_lib, "NATIVE_ROWS_PER_TASK", 3)  # and buffers, for the C copy
    truth = _uneven_run(tmp_path / "run", codec=codec)
    run = reader.open_run(truth.uri)
    want = np.flatnonzero(truth.committed_mask())  # no padding, nothing of partition 2
    per_process = []
    for p in range(process_count):
        # Batches of 7 tokens copied on 3 threads, in tasks of 1 and 2 rows, several
        # batches at once.
        s = _stream(run, process_index=p, process_count=process_count, drop_last=False,
                    epochs=2, gather_threads=3)
        batches = list(s)
        assert len(batches) == 2 * s.steps_per_epoch
        assert [b.step for b in batches] == list(range(len(batches)))
        for b in batches:
            for hook in truth.hooks:
                np.testing.assert_array_equal(b.acts[hook], truth.value(hook, b.rows, b.cols))
            np.testing.assert_array_equal(b.input_ids, truth.tokens["input_ids"][b.rows, b.cols])
            # The values say which token they are, independently of rows / cols.
            np.testing.assert_array_equal(rf.decode_flat(b.acts["embed"], T), b.rows * T + b.cols)
        epochs = [_flat([b for b in batches if b.epoch == e]) for e in (0, 1)]
        assert not np.array_equal(epochs[0], epochs[1])  # a new order each epoch
        per_process.append(epochs)
    for e in (0, 1):
        union = np.concatenate([ep[e] for ep in per_process])
        assert len(union) == len(want) and np.array_equal(np.sort(union), want)
    if process_count > 1:  # each process reads the same blocks every epoch
        for ep in per_process:
            assert np.array_equal(np.sort(ep[0]), np.sort(ep[1]))


def test_drop_last_gives_every_process_the_same_full_batches(tmp_path):
    truth = _uneven_run(tmp_path / "run")
    run = reader.open_run(truth.uri)
    shards = [list(_stream(run, process_index=p, process_count=3, batch_size=5))
              for p in range(3)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) > 3
    assert all(len(b) == 5 for s in shards for b in s)
    union = _flat([b for s in shards for b in s])
    assert len(np.unique(union)) == len(union)
    assert np.isin(union, np.flatnonzero(truth.committed_mask())).all()


def test_seed_fixes_the_order_and_it_is_shuffled(reader_run):
    run = reader.open_run(reader_run.uri)
    a = list(_stream(run, epochs=2))
    # Read in the caller's thread, one block read at a time: the same order.
    b = list(_stream(run, epochs=2, prefetch=0, reads_in_flight=1))
    c = list(_stream(run, epochs=2, seed=4))
    assert np.array_equal(_flat(a), _flat(b)) and not np.array_equal(_flat(a), _flat(c))
    first = _flat([x for x in a if x.epoch == 0])
    assert not np.array_equal(first, np.sort(first))
    # Tokens of one buffer are permuted, not handed out block by block in row order.
    rows = np.concatenate([x.rows for x in a[:3]])
    assert (np.diff(rows) < 0).sum() > 3


def test_resume_mid_epoch_continues_the_same_order(reader_run):
    run = reader.open_run(reader_run.uri)
    s = _stream(run, epochs=3, batch_size=5)
    full = list(s)
    spe = s.steps_per_epoch
    for k in (1, 4, spe - 1, spe, spe + 3, len(full) - 1):
        rest = list(_stream(run, epochs=3, batch_size=5, start_step=k))
        assert [b.step for b in rest] == list(range(k, len(full)))
        assert np.array_equal(_flat(rest), _flat(full[k:]))
        state = json.loads(json.dumps(s.state(full[k - 1])))  # saved as a training job would
        resumed = list(_stream(run, epochs=3, batch_size=5, resume=state))
        assert np.array_equal(_flat(resumed), _flat(full[k:]))
        for x, y in zip(resumed, full[k:]):
            np.testing.assert_array_equal(x.acts["embed"], y.acts["embed"])
    with pytest.raises(ValueError, match="batch_size saved 5, now 6"):
        _stream(run, epochs=3, batch_size=6, resume=s.state(full[3]))


def test_the_typed_resume_state_resumes_as_its_saved_dict_does(reader_run):
    run = reader.open_run(reader_run.uri)
    s = _stream(run, epochs=2, batch_size=5)
    full = list(s)
    typed = s.resume_state(full[2])
    assert typed.next_step == 3 and typed.to_dict() == s.state(full[2])
    assert StreamState.parse(json.loads(json.dumps(typed.to_dict()))) == typed
    resumed = list(_stream(run, epochs=2, batch_size=5, resume=typed))
    assert np.array_equal(_flat(resumed), _flat(full[3:]))
    with pytest.raises(ValueError, match="not a stream state of version 1"):
        _stream(run, epochs=2, batch_size=5, resume={**typed.to_dict(), "version": 2})


def test_a_misspelt_keyword_is_refused_by_name(reader_run):
    run = reader.open_run(reader_run.uri)
    with pytest.raises(TypeError, match="'bufer_tokens'.*buffer_tokens"):
        run.stream("embed", 8, bufer_tokens=4 * T)
    with pytest.raises(TypeError, match="'map_shards'"):  # the stream's, not batches'
        run.batches("embed", 8, map_shards=False)


@pytest.mark.parametrize("codec,file_io_mode", [("zstd", None), ("none", None),
                                               ("none", "default"), ("zstd", "default")])
def test_values_equal_zarr_pythons_read_of_the_arrays(tmp_path, codec, file_io_mode):
    # None: the default for a local run, mapped files; "default": tensorstore's read().
    import zarr

    from actx.reader import zarr_compat

    truth = _uneven_run(tmp_path / "run", dtype="bfloat16", codec=codec)
    zarr_compat.register_bfloat16()
    run = reader.open_run(truth.uri)
    s = _stream(run, drop_last=False, file_io_mode=file_io_mode)
    assert s.file_io_mode == (file_io_mode or "memmap")
    # Without a codec, the shard files are mapped and copied from (tests/test_reader_mapped.py).
    assert s.read_paths["embed"].startswith("mapped" if codec == "none" else "decoded")
    batches = list(s)
    for hook in truth.hooks:
        z = np.asarray(zarr.open_array(str(tmp_path / "run" / "activations" / hook),
                                       mode="r")[:])
        for b in batches:
            assert b.acts[hook].dtype == z.dtype
            np.testing.assert_array_equal(b.acts[hook], z[b.rows, b.cols])
    assert np.array_equal(np.sort(_flat(batches)), np.flatnonzero(truth.committed_mask()))


def test_gcs_run_streams_like_local(gcs_bucket):
    uri = f"{gcs_bucket}/runs/stream"
    truth = rf.build_run(uri, num_partitions=3, rows_per_shard=4, committed=(0, 2))
    run = reader.open_run(uri)
    s = _stream(run, drop_last=False, gcs_request_concurrency=4, reads_in_flight=3)
    assert s.file_io_mode is None  # mapping is for local files only
    assert s.read_paths["embed"].startswith("decoded: gs:// run")
    batches = list(s)
    assert np.array_equal(np.sort(_flat(batches)), np.flatnonzero(truth.committed_mask()))
    for b in batches:
        np.testing.assert_array_equal(b.acts["embed"], truth.value("embed", b.rows, b.cols))


def test_a_batch_draws_from_at_most_two_buffers_of_blocks(tmp_path):
    truth = rf.build_run(str(tmp_path / "run"), num_partitions=4, partition_rows=8,
                         rows_per_shard=4, committed=(0, 1, 2, 3))
    run = reader.open_run(truth.uri)
    small = _stream(run, buffer_tokens=4 * T, block_rows=2, batch_size=8)
    assert small.blocks_per_buffer == 2
    for b in small:
        assert len(np.unique(b.rows // 2)) <= 2 * small.blocks_per_buffer
    # A buffer of the whole run mixes more (measured as bench/read.py does).
    whole = _stream(run, buffer_tokens=32 * T, block_rows=2, batch_size=8)
    narrow, wide = (mixing.measure(run, list(s), block_rows=2) for s in (small, whole))
    assert wide.blocks > narrow.blocks and wide.documents > narrow.documents


def test_jax_arrays_on_a_sharding_and_torch_tensors(tmp_path):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    truth = rf.build_run(str(tmp_path / "run"), dtype="bfloat16", num_partitions=2,
                         rows_per_shard=4)
    run = reader.open_run(truth.uri)
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    n = 2 * len(jax.devices())
    b = next(iter(run.stream("embed", n, buffer_tokens=4 * T, as_jax=True,
                             sharding=sharding)))
    acts = b.acts["embed"]
    assert isinstance(acts, jax.Array) and acts.sharding == sharding
    assert acts.dtype == jax.numpy.bfloat16 and acts.shape == (n, truth.hidden)
    assert {s.device for s in acts.addressable_shards} == set(jax.devices())
    np.testing.assert_array_equal(np.asarray(acts), truth.value("embed", b.rows, b.cols))
    torch = pytest.importorskip("torch")
    t = next(iter(run.stream("embed", 8, buffer_tokens=4 * T, framework="torch")))
    assert t.acts["embed"].dtype == torch.bfloat16
    np.testing.assert_array_equal(t.acts["embed"].float().numpy(),
                                  truth.value("embed", t.rows, t.cols).astype(np.float32))


def test_normalize_with_the_stored_statistics(reader_run):
    run = reader.open_run(reader_run.uri)
    with pytest.raises(reader.ReaderError, match="compute_stats"):
        _stream(run, normalize="standardize")
    run.compute_stats(["embed", "layers.0.resid_post"])
    r, c = np.nonzero(reader_run.committed_mask())
    x = reader_run.value("embed", r, c).astype(np.float64)  # independent of reader.stats
    mean, std = x.mean(axis=0), x.std(axis=0)
    norm = np.linalg.norm(x, axis=1).mean()
    for mode in ("standardize", "unit_mean_norm"):
        for b in _stream(run, normalize=mode, drop_last=False):
            raw = reader_run.value("embed", b.rows, b.cols).astype(np.float64)
            want = (raw - mean) / std if mode == "standardize" else raw * np.sqrt(8) / norm
            assert b.acts["embed"].dtype == np.float32
            np.testing.assert_allclose(b.acts["embed"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("way", ["stream", "batches"])
def test_normalize_says_when_its_statistics_count_other_tokens(reader_run, way):
    """Statistics of every token scale a reader that leaves BOS and special tokens out by
    the wrong amount: a warning says so with the call that computes them over the tokens
    it serves; after that call, as printed, the served tokens' mean norm is sqrt(d). The
    reference: the fixture's values of exactly the tokens served."""
    import warnings

    from actx.reader import formats

    run = reader.open_run(reader_run.uri)
    served = dict(exclude=["bos", "special"], normalize="sqrt_d_mean_norm", drop_last=False)

    def read():
        if way == "stream":
            return list(_stream(run, **served))
        return list(run.batches(["embed", "layers.0.resid_post"], 7, seed=3, **served))

    run.compute_stats(["embed", "layers.0.resid_post"])
    with pytest.warns(formats.StatisticsOfOtherTokens) as said:
        read()
    message = str(said[0].message)
    assert "leave out none but padding, this reader leaves out bos, special" in message
    call = message.split("run.compute_stats(", 1)[1].split(") computes them", 1)[0]
    assert call == "['embed', 'layers.0.resid_post'], exclude=['bos', 'special']", call
    eval(f"run.compute_stats({call})")  # as printed
    with warnings.catch_warnings():
        warnings.simplefilter("error", formats.StatisticsOfOtherTokens)
        batches = read()
    rows = np.concatenate([b.rows for b in batches])
    cols = np.concatenate([b.cols for b in batches])
    for hook in ("embed", "layers.0.resid_post"):
        raw = reader_run.value(hook, rows, cols).astype(np.float64)
        served_norm = np.linalg.norm(raw, axis=1).mean()
        every = np.linalg.norm(reader_run.value(hook, *np.nonzero(
            reader_run.committed_mask())).astype(np.float64), axis=1).mean()
        assert abs(served_norm / every - 1) > 1e-3  # the two scales differ here
        got = np.concatenate([b.acts[hook] for b in batches])
        np.testing.assert_allclose(got, raw * np.sqrt(8) / served_norm, rtol=1e-5, atol=1e-6)


def test_missing_statistics_name_the_call_that_computes_them_for_this_reader(reader_run):
    """A normalising reader without statistics for its hook is refused with the call that
    computes them over the tokens it serves (its exclude= too): run as printed, the same
    reader then reads without a second hint (was: a call for every token, which the reader
    then warned about)."""
    import warnings

    from actx.reader import formats

    run = reader.open_run(reader_run.uri)
    served = dict(exclude=["bos", "special"], normalize="sqrt_d_mean_norm", drop_last=False)
    with pytest.raises(reader.ReaderError) as e:
        list(_stream(run, **served))
    call = str(e.value).split("compute them with ", 1)[1]
    assert call == (f"actx.open_run({reader_run.uri!r}).compute_stats(['embed', "
                    f"'layers.0.resid_post'], exclude=['bos', 'special'])"), call
    import actx

    eval(call, {"actx": actx})  # as printed
    with warnings.catch_warnings():
        warnings.simplefilter("error", formats.StatisticsOfOtherTokens)
        assert list(_stream(reader.open_run(reader_run.uri), **served))


@pytest.mark.parametrize("gather_threads,as_jax", [(1, False), (3, False), (3, True)])
def test_close_midway_ends_every_thread_of_the_stream(reader_run, monkeypatch,
                                                      gather_threads, as_jax):
    monkeypatch.setattr(gather_lib, "ROWS_PER_TASK", 2)  # copies in flight when it closes
    run = reader.open_run(reader_run.uri)
    s = _stream(run, epochs=None, gather_threads=gather_threads, as_jax=as_jax)

    def running():
        return {t.name.rsplit("_", 1)[0] for t in threading.enumerate()
                if t.name.startswith("actx-reader")}

    with s:
        for i, _ in enumerate(s):
            if i == 5:
                during = running()
                break
    want = {"actx-reader-stream", "actx-reader-load"}
    want |= {"actx-reader-gather"} if gather_threads > 1 else set()
    want |= {"actx-reader-stream-cut"} if as_jax else set()
    assert during == want
    assert not s._prefetcher.running
    assert running() == set()


def test_close_midway_and_errors_that_say_what_to_do(reader_run):
    run = reader.open_run(reader_run.uri)
    s = _stream(run, epochs=None)
    with s:
        for i, _ in enumerate(s):
            if i == 5:
                break
    assert not s._prefetcher.running
    with pytest.raises(ValueError, match="raise it to at least 32"):
        _stream(run, buffer_tokens=T)
    with pytest.raises(ValueError, match="less than one batch"):
        _stream(run, batch_size=10_000)
    with pytest.raises(ValueError, match="reads_in_flight must be >= 1"):
        _stream(run, reads_in_flight=0)
    with pytest.raises(ValueError, match="gather_threads must be >= 1"):
        _stream(run, gather_threads=0)
    with pytest.raises(ValueError, match="file_io_mode must be one of default, memmap"):
        _stream(run, file_io_mode="mmap")
    with pytest.raises(reader.UncommittedPartitionError):
        _stream(run, partitions=[1, 2])
    with pytest.raises(reader.UnknownHookError):
        run.stream("layers.7.mlp_out", 4)


def test_streaming_imports_neither_jax_nor_beam(reader_run):
    code = (
        "import sys, reader\n"
        f"run = reader.open_run({reader_run.uri!r})\n"
        "b = next(iter(run.stream('embed', 8, buffer_tokens=64)))\n"
        "assert b.acts['embed'].shape == (8, 8)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'apache_beam', 'torch')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("gather_threads", [1, 3])
def test_recycled_batch_arrays_never_overwrite_what_the_consumer_still_holds(
        reader_run, monkeypatch, gather_threads):
    # Batch arrays are reused once dropped; views or tensors kept from them must keep
    # their values, and batches checked as they come must be right although reused (with
    # 3 threads, several batches are being copied into at any time).
    monkeypatch.setattr(gather_lib, "ROWS_PER_TASK", 2)
    run = reader.open_run(reader_run.uri)
    kept, seen, reused = [], [], 0
    for i, b in enumerate(_stream(run, epochs=4, batch_size=5,
                                  gather_threads=gather_threads)):
        np.testing.assert_array_equal(b.acts["embed"], reader_run.value("embed", b.rows, b.cols))
        # A weak reference to a dropped array stays alive only if the array was reused.
        reused += any(w() is b.acts["embed"] for w in seen)
        seen.append(weakref.ref(b.acts["embed"]))
        if i % 3 == 0:  # a view of the array, not the batch
            kept.append((b.acts["embed"][1:4], b.rows[1:4].copy(), b.cols[1:4].copy()))
    assert reused > 10  # else this test would check nothing
    for view, rows, cols in kept:
        np.testing.assert_array_equal(view, reader_run.value("embed", rows, cols))
    # JAX on CPU may alias the numpy memory without a copy.
    arrays = [(b.acts["embed"], b.rows.copy(), b.cols.copy())
              for b in _stream(run, epochs=2, batch_size=5, as_jax=True)]
    for a, rows, cols in arrays:
        np.testing.assert_array_equal(np.asarray(a), reader_run.value("embed", rows, cols))
    torch = pytest.importorskip("torch")
    tensors = [(b.acts["embed"], b.rows.copy(), b.cols.copy())
               for b in _stream(run, epochs=2, batch_size=5, framework="torch")]
    for t, rows, cols in tensors:
        np.testing.assert_array_equal(t.numpy(), reader_run.value("embed", rows, cols))


def test_exclusions_leave_out_bos_and_special_tokens_every_epoch(tmp_path):
    truth = _uneven_run(tmp_path / "run", packing="concat")  # BOS mid-row too
    run = reader.open_run(truth.uri)
    ids = truth.tokens["input_ids"]
    for kwargs, dropped in (({"exclude_bos": True}, ids == rf.BOS_ID),
                            ({"exclude_special": True}, np.isin(ids, rf.SPECIAL_IDS))):
        want = np.flatnonzero(truth.committed_mask() & ~dropped)
        batches = list(_stream(run, drop_last=False, epochs=2, **kwargs))
        for e in (0, 1):
            got = _flat([b for b in batches if b.epoch == e])
            assert np.array_equal(np.sort(got), want)


def test_a_damaged_block_fails_the_stream_with_the_read_error(tmp_path):
    # A stored object cut short after the stream was opened: its read fails, the error
    # reaches the consumer (from the background thread), and nothing wrong is returned.
    truth = _uneven_run(tmp_path / "run")
    run = reader.open_run(truth.uri)
    s = _stream(run, drop_last=False, epochs=1)
    shard = tmp_path / "run" / "activations" / "embed" / "c" / "1" / "0" / "0"  # rows 4..7
    shard.write_bytes(shard.read_bytes()[:100])
    got = []
    with pytest.raises(reader.ReaderError, match=r"partitions \[0(, \d)*\] failed") as failure:
        for b in s:
            got.append(b)
    message = str(failure.value)
    assert "activations/embed/c/1/0/0" in message and "actx verify" in message
    for b in got:  # whatever came before the failure is right
        np.testing.assert_array_equal(b.acts["embed"], truth.value("embed", b.rows, b.cols))
    assert not s._prefetcher.running


def test_local_runs_read_mapped_files_where_tensorstore_can(reader_run, monkeypatch):
    from actx.reader.storage import read_contexts

    run = reader.open_run(reader_run.uri)
    assert read_contexts.default_file_io_mode(run) == "memmap"

    class OldContext:  # a tensorstore without the file_io_mode resource
        def __init__(self, spec, parent=None):
            raise ValueError('Invalid context resource identifier: "file_io_mode"')

    read_contexts._memmap_supported.cache_clear()
    monkeypatch.setattr(read_contexts.ts, "Context", OldContext)
    try:
        assert read_contexts.default_file_io_mode(run) is None
    finally:
        monkeypatch.undo()
        read_contexts._memmap_supported.cache_clear()
    assert read_contexts.default_file_io_mode(run) == "memmap"

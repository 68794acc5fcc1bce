"""reader.row_copy: the C kernel built here with the machine's compiler, against numpy;
what happens where it cannot be built or is wrong; the stream gives the same batches
either way."""

import os

import ml_dtypes
import numpy as np
import pytest

import reader
from reader import gather as gather_lib
from reader import row_copy
from tests import reader_fixtures as rf

T = 16  # the fixtures' seq_len


def _native():
    copy_rows, why = row_copy.kernel()
    if copy_rows is None:
        pytest.skip(f"no native row copy on this machine: {why}")
    return copy_rows


@pytest.mark.parametrize("dtype,hidden", [(ml_dtypes.bfloat16, 896), (np.float32, 3),
                                          (np.float16, 7), (np.float32, 64)])
def test_kernel_copies_rows_where_numpy_says_streamed_or_not(dtype, hidden):
    copy_rows = _native()
    rng = np.random.default_rng(1)
    src = rng.standard_normal((500, hidden)).astype(dtype)
    rows = np.sort(rng.choice(500, 300, replace=False)).astype(np.int64)  # in source order
    # Targets: rows of two arrays and of a view that starts 4 bytes off 16-byte alignment.
    a = np.zeros((100, hidden), dtype)
    b = np.zeros((150, hidden), dtype)
    raw = np.zeros(60 * hidden * src.itemsize + 64, np.uint8)
    start = (-raw.ctypes.data) % 16 + 4
    c = raw[start:start + 50 * hidden * src.itemsize].view(dtype).reshape(50, hidden)
    targets = [(t, i) for t in (a, b, c) for i in range(len(t))]
    order = rng.permutation(len(targets))
    row_bytes = hidden * src.itemsize
    addresses = np.array([targets[k][0].ctypes.data + targets[k][1] * row_bytes
                          for k in order], np.int64)
    copy_rows(src, rows, addresses)
    for (t, i), r in zip((targets[k] for k in order), rows):
        np.testing.assert_array_equal(t[i].view(np.uint8), src[r].view(np.uint8))


def test_a_compiler_that_fails_falls_back_with_its_reason(tmp_path):
    copy_rows, why = row_copy.load(compiler="false", directory=str(tmp_path))
    assert copy_rows is None and "false failed" in why
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".so")]  # nothing half-built


def test_a_library_is_built_once_into_the_cache_and_reused(tmp_path):
    _native()
    copy_rows, why = row_copy.load(directory=str(tmp_path))
    built = [p for p in os.listdir(tmp_path) if p.endswith(".so")]
    assert copy_rows is not None and len(built) == 1 and why.endswith(built[0])
    mtime = os.path.getmtime(tmp_path / built[0])
    again, why_again = row_copy.load(directory=str(tmp_path))
    assert why_again == why and os.path.getmtime(tmp_path / built[0]) == mtime


def test_a_kernel_that_copies_wrong_is_refused():
    def off_by_one(src, rows, addresses):  # copies the row after the one asked for
        for r, a in zip(rows, addresses):
            row = src[min(r + 1, len(src) - 1)]
            np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * row.nbytes).from_address(
                int(a)))[:] = row.view(np.uint8)

    assert "self-check failed" in row_copy._self_check(off_by_one)
    assert row_copy._self_check(_native()) == ""


def test_actx_row_copy_numpy_turns_it_off(reader_run, monkeypatch):
    monkeypatch.setattr(row_copy, "_loaded", None)
    monkeypatch.setenv("ACTX_ROW_COPY", "numpy")
    s = reader.open_run(reader_run.uri).stream("embed", 8, buffer_tokens=4 * T, block_rows=2)
    assert s.copy_path == "numpy: ACTX_ROW_COPY=numpy"


def _batches(run, native, **kwargs):
    args = dict(buffer_tokens=6 * T, block_rows=2, seed=5, epochs=2, drop_last=False,
                gather_threads=3)
    args.update(kwargs)
    with run.stream(["embed", "layers.0.resid_post"], args.pop("batch_size", 7),
                    native_copy=native, **args) as s:
        assert s.copy_path.startswith("native" if native else "numpy")
        batches = [(b.step, b.rows.copy(), b.cols.copy(),
                    {h: np.asarray(a).copy() for h, a in b.acts.items()}) for b in s]
        assert [b[0] for b in batches] == list(range(s.start_step, s.stop_step))
        return batches


@pytest.mark.parametrize("codec", ["none", "zstd"])  # mapped files / decoded buffers
@pytest.mark.parametrize("case", [
    {},  # batches of 7 across buffers of 6 rows
    {"batch_size": 150},  # every batch spans two or three buffers
    {"prefetch_buffers": 0},  # one slot: the next read waits for the copies
    {"prefetch_buffers": 2, "gather_threads": 1},  # copies on the thread that cuts
    {"drop_last": True, "start_step": 5},  # epochs cut short, a buffer resumed mid-way
])
def test_the_stream_gives_the_same_batches_with_either_copy(tmp_path, monkeypatch, codec,
                                                            case):
    _native()
    monkeypatch.setattr(gather_lib, "NATIVE_ROWS_PER_TASK", 5)  # several tasks per buffer
    truth = rf.build_run(str(tmp_path / "run"), num_partitions=4, partition_rows=8,
                         last_partition_rows=4, rows_per_shard=4, committed=(0, 1, 3),
                         codec=codec)
    run = reader.open_run(truth.uri)
    native, numpy = _batches(run, True, **case), _batches(run, False, **case)
    assert [b[0] for b in native] == [b[0] for b in numpy] and native
    for (_, rows, cols, acts), (_, rows_np, cols_np, acts_np) in zip(native, numpy):
        np.testing.assert_array_equal(rows, rows_np)
        np.testing.assert_array_equal(cols, cols_np)
        for h, a in acts.items():
            np.testing.assert_array_equal(a.view(np.uint8), acts_np[h].view(np.uint8))
            np.testing.assert_array_equal(a, truth.value(h, rows, cols))


def test_a_library_others_could_replace_is_not_loaded(tmp_path):
    _native()
    shared = tmp_path / "shared"
    shared.mkdir()
    assert row_copy.load(directory=str(shared))[0] is not None
    os.chmod(shared, 0o777)  # anyone could put their own library there
    copy_rows, why = row_copy.load(directory=str(shared))
    # Refused there; the per-user directory under the temporary directory serves instead.
    assert copy_rows is None or not why.startswith(f"native: {shared}")
    assert row_copy._not_ours(str(shared)).endswith("mode 40777)")

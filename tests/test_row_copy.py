"""reader.storage.row_copy: the C kernel built at install (reader._row_copy), against numpy;
what happens where it was not built or is wrong; the stream gives the same batches
either way."""

import logging
import types

import ml_dtypes
import numpy as np
import pytest

from actx import reader
from actx.reader.streaming import gather as gather_lib
from actx.reader.storage import row_copy
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


def test_an_install_without_the_extension_copies_with_numpy_and_logs_it_once(
        reader_run, monkeypatch, caplog):
    monkeypatch.setattr(row_copy, "_built", None)
    monkeypatch.setattr(row_copy, "_NOT_BUILT", "No module named 'actx.reader._row_copy'")
    monkeypatch.setattr(row_copy, "_loaded", None)
    monkeypatch.delenv("ACTX_ROW_COPY", raising=False)
    run = reader.open_run(reader_run.uri)
    with caplog.at_level(logging.WARNING, logger=row_copy.__name__):
        for _ in range(2):
            s = run.stream("embed", 8, buffer_tokens=4 * T, block_rows=2)
            assert s.copy_path.startswith("numpy: actx.reader._row_copy was not built at install")
    warnings = [r for r in caplog.records if r.name == row_copy.__name__]
    assert len(warnings) == 1 and "numpy" in warnings[0].getMessage()


def test_a_module_of_another_version_is_refused():
    other = types.SimpleNamespace(__name__="actx.reader._row_copy", version=lambda: 1,
                                  copy_rows=None)
    copy_rows, why = row_copy.load(other)
    assert copy_rows is None and "version 1, expected 2" in why


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

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


# -- float8 hooks: dequantised in the copy ----------------------------------------------

# e4m3fn bytes the rule must get right: +-0, the smallest and largest subnormals, the
# smallest normal, 1, the largest finite (+-448); 0x7F and 0xFF are NaN (left out: the
# quantisation never writes them).
_EDGE_BYTES = [0x00, 0x80, 0x01, 0x81, 0x07, 0x87, 0x08, 0x88, 0x38, 0xB8, 0x7E, 0xFE]


def _reference(values: np.ndarray, scales: np.ndarray, dtype: str) -> np.ndarray:
    """schemas.quantised's rule written out with ml_dtypes' casts alone: float8 -> float32,
    times the token's float32 scale, rounded once to the output dtype."""
    product = values.astype(np.float32) * scales
    return product if dtype == "float32" else product.astype(ml_dtypes.bfloat16)


def _float8_case(rng, n: int, hidden: int):
    raw = rng.integers(0, 256, (n, hidden), dtype=np.uint8)
    raw[np.isin(raw, [0x7F, 0xFF])] = 0x38
    raw[1] = 0  # a zero row (padding), whose scale is 1
    raw[2, :len(_EDGE_BYTES[:hidden])] = _EDGE_BYTES[:hidden]
    raw[3] = np.resize(np.array(_EDGE_BYTES, np.uint8), hidden)
    scales = (np.exp2(rng.integers(-30, 30, (n, 1))) * rng.uniform(0.5, 1, (n, 1))
              ).astype(np.float32)
    scales[1] = scales[2] = 1  # scale 1: the stored values themselves
    scales[4] = np.float32(1e-38)  # products in float32's subnormals
    scales[5] = np.float32(3e38 / 448)  # products up to float32's largest
    return raw.view(ml_dtypes.float8_e4m3fn), scales


@pytest.mark.parametrize("hidden", [896, 64, 8, 7, 3, 1])  # streamed (x8) or plain stores
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float8_kernel_dequantises_bit_for_bit_as_the_rule(hidden, dtype):
    """Every row into targets of two arrays and a view 4 bytes off 16-byte alignment, in
    scattered order, with the scale of a row of another array (as a mapped hook's are)."""
    dequantise_rows, why = row_copy.dequantise_kernel()
    if dequantise_rows is None:
        pytest.skip(f"no native row copy on this machine: {why}")
    rng = np.random.default_rng(hidden)
    values, scales = _float8_case(rng, 300, hidden)
    scale_source = np.zeros((400, 1), np.float32)
    scale_at = rng.choice(400, 300, replace=False).astype(np.int64)
    scale_source[scale_at] = scales
    rows = np.arange(300, dtype=np.int64)
    want = _reference(values, scales, dtype)
    out_dtype, itemsize = want.dtype, want.itemsize
    a = np.zeros((100, hidden), out_dtype)
    b = np.zeros((150, hidden), out_dtype)
    raw = np.zeros(60 * hidden * itemsize + 64, np.uint8)
    start = (-raw.ctypes.data) % 16 + 4
    c = raw[start:start + 50 * hidden * itemsize].view(out_dtype).reshape(50, hidden)
    targets = [(t, i) for t in (a, b, c) for i in range(len(t))]
    order = rng.permutation(len(targets))
    addresses = np.array([targets[k][0].ctypes.data + targets[k][1] * hidden * itemsize
                          for k in order], np.int64)
    dequantise_rows(values, rows, addresses, scale_source, scale_at, "float8_e4m3fn",
                    dtype == "bfloat16")
    got = np.stack([targets[k][0][targets[k][1]] for k in order])
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    assert not np.isnan(got.astype(np.float32)).any()  # the case is NaN-free as promised
    assert (got[1].astype(np.float32) == 0).all()


@pytest.mark.parametrize("hidden", [896, 7])  # the pair table, and one value at a time
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_numpys_dequantise_is_bit_for_bit_the_rule(hidden, dtype):
    """The fallback (schemas.quantised.dequantise), NaN bytes included (kept NaN)."""
    from actx.schemas import quantised

    rng = np.random.default_rng(hidden)
    values, scales = _float8_case(rng, 64, hidden)
    values.view(np.uint8)[6, :2] = [0x7F, 0xFF]
    want = _reference(values, scales, dtype)
    np.testing.assert_array_equal(quantised.dequantise(values, scales, dtype).view(np.uint8),
                                  want.view(np.uint8))
    out = np.empty_like(want)
    quantised.dequantise(values, scales, dtype, out=out)
    np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))


def _float8_batches(run, native, **kwargs):
    hooks = ["embed", "layers.0.resid_post"]
    with run.stream(hooks, 7, buffer_tokens=6 * T, block_rows=2, seed=5, epochs=2,
                    native_copy=native, gather_threads=3, **kwargs) as s:
        assert s.dequantised_in_copy == (tuple(hooks) if native else ())
        return [(b.rows.copy(), b.cols.copy(),
                 {h: np.asarray(a).copy() for h, a in b.acts.items()}) for b in s]


@pytest.mark.parametrize("codec", ["none", "zstd"])  # mapped files / decoded buffers
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_a_float8_stream_dequantised_in_the_copy_equals_numpys(tmp_path, monkeypatch, codec,
                                                               dtype):
    _native()
    monkeypatch.setattr(gather_lib, "NATIVE_ROWS_PER_TASK", 5)  # several tasks per buffer
    truth = rf.build_run(str(tmp_path / "run"), num_partitions=4, partition_rows=8,
                         rows_per_shard=4, dtype="float8_e4m3", codec=codec,
                         random_values=True)
    run = reader.open_run(truth.uri)
    native = _float8_batches(run, True, dtype=dtype)
    numpy = _float8_batches(run, False, dtype=dtype)
    assert len(native) == len(numpy) > 1
    for (rows, cols, acts), (rows_np, cols_np, acts_np) in zip(native, numpy):
        np.testing.assert_array_equal(rows, rows_np)
        np.testing.assert_array_equal(cols, cols_np)
        assert sorted(acts) == sorted(acts_np) == ["embed", "layers.0.resid_post"]
        for h, a in acts.items():
            values = truth.arrays[h][rows, cols]
            scales = truth.arrays[h + ".scale"][rows, cols]
            want = _reference(values, scales, dtype or "float32")
            np.testing.assert_array_equal(a.view(np.uint8), want.view(np.uint8))
            np.testing.assert_array_equal(acts_np[h].view(np.uint8), want.view(np.uint8))


def test_jax_batches_keep_float8_for_the_device(tmp_path):
    """framework="jax" without normalisation: the copy keeps the float8 bytes and scales
    (multiplied on the device, formats.hand_over); normalised JAX batches dequantise in it."""
    _native()
    truth = rf.build_run(str(tmp_path / "run"), dtype="float8_e4m3", codec="none")
    run = reader.open_run(truth.uri)
    with run.stream("embed", 8, buffer_tokens=4 * T, block_rows=2, framework="jax") as s:
        assert s.dequantised_in_copy == ()


def test_a_float8_kernel_that_rounds_wrong_is_refused():
    """bfloat16 truncated instead of rounded to nearest even: refused by the load check."""
    from actx.schemas import quantised

    def truncating(src, rows, addresses, scales, scale_rows, stored, bfloat16):
        for r, a, s in zip(rows, addresses, scale_rows):
            product = quantised.dequantise(src[r:r + 1], scales[s:s + 1])[0]
            if bfloat16:
                product = (product.view(np.uint32) >> 16).astype(np.uint16)
            np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * product.nbytes).from_address(
                int(a)))[:] = product.view(np.uint8)

    assert "self-check failed (float8 float8_e4m3fn as bfloat16" in \
        row_copy._self_check_dequantise(truncating)
    dequantise_rows, why = row_copy.dequantise_kernel()
    if dequantise_rows is not None:
        assert row_copy._self_check_dequantise(dequantise_rows) == ""

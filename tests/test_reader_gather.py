"""reader.gather: the threaded copy into batches equals numpy's fancy indexing."""

import ml_dtypes
import numpy as np
import pytest

from reader import gather as gather_lib


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("k", [0, 1, 255, 256, 1000])
def test_gather_equals_fancy_indexing(threads, k):
    rng = np.random.default_rng(k)
    src = rng.standard_normal((1500, 24)).astype(ml_dtypes.bfloat16)
    idx = rng.permutation(len(src))[:k]
    out = np.full((k, 24), np.nan, src.dtype)
    g = gather_lib.Gather(threads)
    try:
        g(src, idx, out)
    finally:
        g.close()
    np.testing.assert_array_equal(out.view(np.uint16), src[idx].view(np.uint16))


def test_parts_go_to_other_threads_when_large_enough(monkeypatch):
    import threading

    calls = []
    real = gather_lib._take

    def spy(src, idx, out):
        calls.append((threading.current_thread().name, len(idx)))
        real(src, idx, out)

    monkeypatch.setattr(gather_lib, "_take", spy)
    g = gather_lib.Gather(3)
    src = np.arange(3000 * 4, dtype=np.float32).reshape(3000, 4)
    out = np.empty((900, 4), np.float32)
    g(src, np.arange(900)[::-1].copy(), out)
    g.close()
    np.testing.assert_array_equal(out, src[899::-1])
    # 900 rows: three parts of 300 (>= MIN_ROWS_PER_THREAD each), two of them handed to
    # the pool (whose one idle thread may take both).
    assert sorted(n for _, n in calls) == [300, 300, 300]
    assert sum(name != "MainThread" for name, _ in calls) == 2
    with pytest.raises(ValueError, match="gather_threads must be >= 1"):
        gather_lib.Gather(0)

"""reader.streaming.gather: the threaded copy into batches equals numpy's fancy indexing."""

import threading

import ml_dtypes
import numpy as np
import pytest

from actx.reader.streaming import gather as gather_lib


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("k", [0, 1, 255, 1024, 1025, 3000])
def test_gather_equals_fancy_indexing(threads, k):
    rng = np.random.default_rng(k)
    src = rng.standard_normal((4000, 24)).astype(ml_dtypes.bfloat16)
    idx = rng.permutation(len(src))[:k]
    out = np.full((k, 24), np.nan, src.dtype)
    g = gather_lib.Gather(threads)
    try:
        for copy in g.submit(src, idx, out):
            copy.result()
    finally:
        g.close()
    np.testing.assert_array_equal(out.view(np.uint16), src[idx].view(np.uint16))


def test_copies_go_to_the_pool_in_tasks_and_run_at_once(monkeypatch):
    calls = []
    real = gather_lib._take
    started = threading.Barrier(3, timeout=10)

    def spy(src, idx, out):
        calls.append((threading.current_thread().name, len(idx)))
        started.wait()  # three tasks running at the same time, or the barrier breaks
        real(src, idx, out)

    monkeypatch.setattr(gather_lib, "_take", spy)
    g = gather_lib.Gather(3)
    src = np.arange(6000 * 4, dtype=np.float32).reshape(6000, 4)
    out = np.empty((3000, 4), np.float32)
    copies = g.submit(src, np.arange(3000)[::-1].copy(), out)
    for copy in copies:
        copy.result()
    g.close()
    np.testing.assert_array_equal(out, src[2999::-1])
    # 3000 rows: three tasks of 1000 (ROWS_PER_TASK 1024 at most), all on pool threads.
    assert sorted(n for _, n in calls) == [1000, 1000, 1000]
    assert all(name.startswith("actx-reader-gather") for name, _ in calls)


def test_one_thread_copies_on_the_callers_thread():
    g = gather_lib.Gather(1)
    src = np.arange(20, dtype=np.float32).reshape(10, 2)
    out = np.empty((3, 2), np.float32)
    assert g.submit(src, np.array([4, 0, 9]), out) == []  # done already
    np.testing.assert_array_equal(out, src[[4, 0, 9]])
    g.close()
    with pytest.raises(ValueError, match="gather_threads must be >= 1"):
        gather_lib.Gather(0)

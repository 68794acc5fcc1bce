"""reader.storage.read_window: real tensorstore reads (an in-memory array into numpy), queued from one
thread and topped up from another, as the stream does."""

import threading

import numpy as np
import tensorstore as ts

from actx.reader.storage import read_window

ROWS, WIDTH = 64, 1024


def _source() -> ts.TensorStore:
    return ts.array(np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH))


def test_reads_queued_from_one_thread_and_pumped_from_another_all_land_once():
    source = _source()
    want = source.read().result()
    window = read_window.ReadWindow(2)
    target = np.zeros((ROWS, WIDTH), np.float32)
    groups = [read_window.ReadGroup() for _ in range(ROWS // 4)]
    issued: list[int] = []
    lock = threading.Lock()

    def read_of(row: int):
        def read():
            with lock:
                issued.append(row)
            return ts.array(target[row:row + 1], copy=False, write=True).write(
                source[row:row + 1])
        return read

    def queue_all():  # the stream's loading thread
        for g, group in enumerate(groups):
            for row in range(4 * g, 4 * g + 4):
                window.add(group, read_of(row))
            window.pump()

    loader = threading.Thread(target=queue_all)
    loader.start()
    for group in groups:  # the cutting thread: waits for each buffer in order
        while not group.futures and not group.queued:
            pass  # not queued yet
        window.wait(group)
    loader.join()
    for group in groups:
        window.wait(group)
    assert sorted(issued) == list(range(ROWS))  # every read issued once
    assert issued == sorted(issued)  # in queue order
    np.testing.assert_array_equal(target, want)


def test_never_more_than_in_flight_reads_and_cancel_drops_later_ones():
    source = _source()
    window = read_window.ReadWindow(3)
    target = np.zeros((ROWS, WIDTH), np.float32)
    group = read_window.ReadGroup()
    for row in range(ROWS):
        window.add(group, lambda row=row: ts.array(target[row:row + 1], copy=False,
                                                   write=True).write(source[row:row + 1]))
    window.pump()
    assert len(group.futures) == 3 and group.queued == ROWS - 3
    window.cancel()
    late = read_window.ReadGroup()
    window.add(late, lambda: (_ for _ in ()).throw(AssertionError("issued after cancel")))
    window.pump()
    assert late.queued == 0 and not late.futures

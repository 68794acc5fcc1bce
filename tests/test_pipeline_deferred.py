"""Background writes of a DoFn: its outputs leave in order, only once the writes they stand
for are done; at most max_pending wait; a failed write fails the bundle."""

import threading

import pytest
from apache_beam.pvalue import TaggedOutput
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from actx.pipeline import deferred


def test_outputs_wait_for_their_writes_and_keep_their_order():
    d = deferred.DeferredOutputs(threads=2, max_pending=3)
    gate = threading.Event()
    slow = d.submit(gate.wait)
    assert list(d.add([slow], ["a"])) == []  # its write is still running
    quick = d.submit(lambda: None)
    quick.result()
    assert list(d.add([quick], ["b"])) == []  # done, but behind "a"
    gate.set()
    slow.result()
    assert list(d.add([], ["c"])) == ["a", "b", "c"]
    d.close()


def test_at_most_max_pending_wait():
    d = deferred.DeferredOutputs(threads=1, max_pending=1)
    gate = threading.Event()
    first = d.submit(gate.wait)
    assert list(d.add([first], ["a"])) == []
    threading.Timer(0.05, gate.set).start()
    second_gate = threading.Event()
    assert list(d.add([d.submit(second_gate.wait)], ["b"])) == ["a"]  # waited for "a"
    assert first.done()
    second_gate.set()
    d.close()


def test_finish_returns_windowed_values_and_raises_a_failed_write():
    d = deferred.DeferredOutputs()
    gate = threading.Event()
    assert list(d.add([d.submit(gate.wait)], ["x", TaggedOutput("rejects", "r")])) == []
    gate.set()
    out = list(d.finish())  # what finish_bundle returns: windowed, tags kept
    values = [o.value if isinstance(o, TaggedOutput) else o for o in out]
    assert all(isinstance(v, WindowedValue) and v.windows == (GlobalWindow(),)
               for v in values)
    assert [v.value for v in values] == ["x", "r"] and out[1].tag == "rejects"

    def fail():
        raise OSError("disk full")

    list(d.add([d.submit(fail)], ["y"]))
    with pytest.raises(OSError, match="disk full"):
        list(d.finish())
    d.close()

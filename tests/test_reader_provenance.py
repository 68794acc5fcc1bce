"""ARC provenance selections, checked against the token store read directly."""

import numpy as np
import pytest
import tensorstore as ts

from actx import reader
from actx.schemas import layout
from tests import reader_fixtures as rf


def _token_store(uri, name):
    # Read straight through tensorstore, not through the reader: the independent reference.
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                    "path": f"{uri}/tokens/{name}/"}}).result()[...].read().result()


def test_test_input_cells_of_a_task(reader_run):
    run = reader.open_run(reader_run.uri)
    sel = run.select(["embed"], arc_task="task_a", arc_grid="test_input", cells_only=True)
    t = {n: _token_store(reader_run.uri, n) for n in layout.ALL_TOKEN_ARRAYS}
    committed_rows = np.arange(t["arc_task"].shape[0]) < 16
    want = ((t["arc_task"] == rf.ARC_TASKS.index("task_a")) & (t["arc_grid"] == 2)
            & (t["arc_row"] >= 0) & committed_rows[:, None])
    r, c = np.nonzero(want)
    assert len(r) > 0 and len(r) % 4 == 0  # whole 2x2 grids
    np.testing.assert_array_equal(sel.rows, r)
    np.testing.assert_array_equal(sel.cols, c)
    np.testing.assert_array_equal(sel.input_ids, t["input_ids"][r, c])
    np.testing.assert_array_equal(sel.acts["embed"], reader_run.value("embed", r, c))


def test_other_filters_and_errors(reader_run):
    run = reader.open_run(reader_run.uri)
    t = reader_run.tokens
    sel = run.select("layers.0.resid_post", arc_part="assistant", arc_variant=1)
    want = (t["arc_part"] == 2) & (t["arc_variant"] == 1) & reader_run.committed_mask()
    assert np.array_equal(sel.rows * 16 + sel.cols, np.flatnonzero(want))
    sel = run.select("embed", arc_task=1, arc_grid="train_output", partitions=[1])
    want = (t["arc_task"] == 1) & (t["arc_grid"] == 1)
    want[:8] = False
    want[16:] = False
    assert np.array_equal(sel.rows * 16 + sel.cols, np.flatnonzero(want))
    with pytest.raises(KeyError, match="task_a, task_b"):
        run.select("embed", arc_task="nope")
    with pytest.raises(reader.UncommittedPartitionError):
        run.select("embed", arc_task=0, partitions=[2])

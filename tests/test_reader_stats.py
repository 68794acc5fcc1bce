"""Per-hook statistics against numpy over the ground-truth values."""

import numpy as np

from actx import reader
from actx.schemas import layout
from tests import reader_fixtures as rf


def test_stats_match_numpy_and_are_stored(reader_run):
    run = reader.open_run(reader_run.uri)
    stats = run.compute_stats(exclude_bos=True)
    mask = reader_run.committed_mask()
    mask &= ~((reader_run.tokens["input_ids"] == rf.BOS_ID) & (reader_run.tokens["positions"] == 0))
    r, c = np.nonzero(mask)
    for hook in reader_run.hooks:
        x = reader_run.value(hook, r, c).astype(np.float64)
        s = stats[hook]
        assert s.count == len(r) and s.partitions == (0, 1) and s.exclude_bos
        np.testing.assert_allclose(s.mean, x.mean(0), rtol=1e-12)
        np.testing.assert_allclose(s.var, x.var(0), rtol=1e-9)
        np.testing.assert_allclose(s.mean_norm, np.linalg.norm(x, axis=1).mean(), rtol=1e-12)
        loaded = reader.open_run(reader_run.uri).stats(hook)
        np.testing.assert_array_equal(loaded.mean, s.mean)
        assert loaded.count == s.count
    run.compute_stats(["embed"], partitions=[0])  # other hooks' entries are kept
    data = run.store.read_json(layout.STATS_KEY)["hooks"]
    assert data["embed"]["partitions"] == [0] and data["layers.0.resid_post"]["partitions"] == [0, 1]


def test_damaged_statistics_name_the_call_that_computes_them_again(reader_run):
    """stats.json cut short (not JSON) stopped `actx status` and every statistics read with
    "rewrite it or delete it"; it is derived data: status goes on, a read names the
    compute_stats call, and that call, run as named, writes it anew."""
    import io
    import os
    import re

    import pytest

    from actx.deploy import cli

    run = reader.open_run(reader_run.uri)
    run.compute_stats(["embed"])
    want = run.stats("embed")
    path = os.path.join(reader_run.uri, layout.STATS_KEY)
    whole = open(path, "rb").read()
    open(path, "wb").write(whole[:len(whole) // 2])
    assert cli.main(["status", reader_run.uri], out=io.StringIO()) == 0
    with pytest.raises(reader.errors.ReaderError, match="the run's statistics are damaged") as e:
        reader.open_run(reader_run.uri).stats("embed")
    [call] = re.findall(r"compute them again with (actx\.open_run\(.*?\)\.compute_stats\(.*?\))",
                        str(e.value))
    import actx
    eval(call, {"actx": actx})  # as named
    got = reader.open_run(reader_run.uri).stats("embed")
    np.testing.assert_array_equal(got.mean, want.mean)
    assert got.count == want.count

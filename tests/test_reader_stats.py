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

"""The global shuffle: exactly once per epoch, seeded, resumable, split across processes."""

import numpy as np
import pytest

import reader
from tests import reader_fixtures as rf


def _flat(batches):
    return np.concatenate([b.rows * 16 + b.cols for b in batches])


def test_every_valid_committed_token_exactly_once_and_values_match(reader_run):
    run = reader.open_run(reader_run.uri)
    batches = list(run.batches(["embed", "layers.0.resid_post"], 10, drop_last=False))
    got = _flat(batches)
    want = np.flatnonzero(reader_run.committed_mask())  # no padding, no partition 2
    assert len(got) == len(want) and np.array_equal(np.sort(got), want)
    for b in batches:
        for hook in reader_run.hooks:
            assert not (b.acts[hook] == rf.PAD_VALUE).any()
            np.testing.assert_array_equal(b.acts[hook], reader_run.value(hook, b.rows, b.cols))
        np.testing.assert_array_equal(b.input_ids, reader_run.tokens["input_ids"][b.rows, b.cols])
        # The values themselves say which token they are (independent of rows/cols).
        np.testing.assert_array_equal(rf.decode_flat(b.acts["embed"], 16), b.rows * 16 + b.cols)


def test_seed_fixes_the_order_and_epochs_differ(reader_run):
    run = reader.open_run(reader_run.uri)
    a = _flat(run.batches("embed", 8, seed=1))
    b = _flat(run.batches("embed", 8, seed=1, prefetch=0))
    mem = list(run.batches("embed", 8, seed=1, in_memory=True))
    assert np.array_equal(_flat(mem), a)
    for m in mem:
        np.testing.assert_array_equal(m.acts["embed"], reader_run.value("embed", m.rows, m.cols))
    c = _flat(run.batches("embed", 8, seed=2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert not np.array_equal(a, np.sort(a))  # actually shuffled
    two = run.batches("embed", 8, seed=1, epochs=2)
    e0, e1 = np.split(_flat(two), 2)
    assert np.array_equal(e0, a) and not np.array_equal(e0, e1)


def test_resume_at_step_k_continues_the_same_order(reader_run):
    run = reader.open_run(reader_run.uri)
    full = list(run.batches("embed", 8, seed=5, epochs=3))
    for k in (0, 7, len(full) // 3, len(full) - 1):
        rest = list(run.batches("embed", 8, seed=5, epochs=3, start_step=k))
        assert [b.step for b in rest] == [b.step for b in full[k:]]
        assert np.array_equal(_flat(rest), _flat(full[k:]))


@pytest.mark.parametrize("drop_last", [False, True])
def test_process_shards_are_disjoint_and_cover(reader_run, drop_last):
    run = reader.open_run(reader_run.uri)
    shards = [_flat(run.batches("embed", 6, seed=0, process_index=p, process_count=3,
                                drop_last=drop_last)) for p in range(3)]
    union = np.concatenate(shards)
    assert len(np.unique(union)) == len(union)  # disjoint
    want = np.flatnonzero(reader_run.committed_mask())
    if drop_last:
        assert len({len(s) for s in shards}) == 1
        assert len(union) == len(want) // 18 * 18 and np.isin(union, want).all()
    else:
        assert np.array_equal(np.sort(union), want)
    # The shards interleave into one trainer's order with the global batch size.
    single = _flat(run.batches("embed", 18, seed=0, drop_last=drop_last))
    full = (len(want) // 18) * 18
    merged = np.concatenate([s[i * 6:(i + 1) * 6] for i in range(full // 18) for s in shards])
    assert np.array_equal(merged, single[:full])


def test_exclusions_drop_bos_and_special_tokens(reader_run):
    run = reader.open_run(reader_run.uri)
    mask = reader_run.committed_mask()
    ids, pos = reader_run.tokens["input_ids"], reader_run.tokens["positions"]
    got = run.batches("embed", 4, exclude_bos=True, drop_last=False)
    want = mask & ~((ids == rf.BOS_ID) & (pos == 0))
    assert np.array_equal(np.sort(_flat(got)), np.flatnonzero(want))
    got = run.batches("embed", 4, exclude_special=True, drop_last=False)
    want = mask & ~np.isin(ids, rf.SPECIAL_IDS)
    assert np.array_equal(np.sort(_flat(got)), np.flatnonzero(want))


def test_close_stops_prefetch_midway_and_errors_surface(reader_run):
    run = reader.open_run(reader_run.uri)
    batches = run.batches("embed", 2, epochs=None, prefetch=3)
    with batches:
        for i, b in enumerate(batches):
            if i == 5:
                break
    assert batches._thread is None
    with pytest.raises(ValueError, match="do not fill one global batch"):
        run.batches("embed", 10_000)


def test_jax_and_torch_outputs(tmp_path):
    truth = rf.build_run(str(tmp_path / "run"), dtype="bfloat16", num_partitions=2)
    run = reader.open_run(truth.uri)
    b = next(iter(run.batches("embed", 8, as_jax=True)))
    import jax.numpy as jnp

    assert isinstance(b.acts["embed"], jnp.ndarray) and b.acts["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(b.acts["embed"]), truth.value("embed", b.rows, b.cols))
    torch = pytest.importorskip("torch")
    t = next(iter(run.batches("embed", 8, framework="torch")))
    assert t.acts["embed"].dtype == torch.bfloat16
    np.testing.assert_array_equal(t.acts["embed"].float().numpy(),
                                  truth.value("embed", t.rows, t.cols).astype(np.float32))
    f = next(iter(run.batches("embed", 8, dtype="float32")))
    assert f.acts["embed"].dtype == np.float32

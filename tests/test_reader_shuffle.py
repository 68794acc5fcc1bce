"""The global shuffle: exactly once per epoch, seeded, resumable, split across processes."""

import threading
import time

import numpy as np
import pytest

from actx import reader
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


def _within(fn, seconds: float = 10.0):
    """fn() in a daemon thread; fails (instead of hanging the suite) if it does not return.

    The iterator lives only in that thread, so a hung close() can not be re-run by the
    generator's own `finally` when the test drops it."""
    done, result = threading.Event(), {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # re-raised in the test
            result["error"] = e
        done.set()

    threading.Thread(target=target, daemon=True).start()
    assert done.wait(seconds), "close() hung behind the prefetch thread"
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.mark.parametrize("prefetch,unread", [(2, 1), (2, 2), (3, 3), (1, 1)])
def test_close_after_stopping_near_the_end_returns_promptly(reader_run, prefetch, unread):
    # The last `prefetch` batches are queued and the end marker waits for room: close()
    # must not wait behind that put.
    run = reader.open_run(reader_run.uri)
    batches = run.batches("embed", 16, prefetch=prefetch)
    n = len(batches)
    assert n > unread

    def scenario():
        it = iter(batches)
        for _ in range(n - unread):
            next(it)
        time.sleep(0.5)  # let the producer read the rest and block on the full queue
        t0 = time.perf_counter()
        batches.close()
        return time.perf_counter() - t0

    assert _within(scenario) < 5
    assert batches._thread is None


def test_close_returns_promptly_when_the_producer_fails_behind_a_full_queue(reader_run,
                                                                            monkeypatch):
    run = reader.open_run(reader_run.uri)
    batches = run.batches("embed", 4, prefetch=2)
    read_step = batches.read_step

    def failing(step, order=None):
        if step >= 3:
            raise RuntimeError("read failed")
        return read_step(step, order)

    monkeypatch.setattr(batches, "read_step", failing)

    def scenario():
        it = iter(batches)
        next(it)
        time.sleep(0.5)  # steps 1 and 2 queued; the error waits for room
        batches.close()

    _within(scenario)
    # Without close, the error reaches the consumer after the queued batches.
    batches = run.batches("embed", 4, prefetch=2)
    monkeypatch.setattr(batches, "read_step", failing)
    steps = []
    with pytest.raises(RuntimeError, match="read failed"):
        for b in batches:
            steps.append(b.step)
    assert steps == [0, 1, 2] and batches._thread is None


def test_exclude_bos_drops_bos_mid_row_in_concat_packing(tmp_path):
    # concat: a row is one stream across documents, positions are columns, so a document's
    # BOS inside a row has position > 0 and must still be left out.
    truth = rf.build_run(str(tmp_path / "run"), packing="concat", num_partitions=2,
                         committed=(0, 1))
    ids, pos = truth.tokens["input_ids"], truth.tokens["positions"]
    mid_row_bos = (ids == rf.BOS_ID) & (pos > 0)
    assert mid_row_bos.sum() > 3
    assert np.array_equal(pos[0], np.arange(16))
    run = reader.open_run(truth.uri)
    got = _flat(run.batches("embed", 4, exclude_bos=True, drop_last=False))
    want = truth.committed_mask() & (ids != rf.BOS_ID)
    assert np.array_equal(np.sort(got), np.flatnonzero(want))
    stats = run.compute_stats(["embed"], exclude_bos=True, write=False)["embed"]
    assert stats.count == want.sum()


def test_exclude_bos_in_segmented_rows_leaves_out_document_starts(reader_run):
    run = reader.open_run(reader_run.uri)
    ids, pos = reader_run.tokens["input_ids"], reader_run.tokens["positions"]
    mask = reader_run.committed_mask()
    bos = mask & (ids == rf.BOS_ID)
    assert bos.any() and (pos[bos] == 0).all()  # segmented: BOS opens each document
    got = _flat(run.batches("embed", 4, exclude_bos=True, drop_last=False))
    assert np.array_equal(np.sort(got), np.flatnonzero(mask & ~bos))


def test_continued_shares_keep_every_process_within_one_token_however_the_epoch_is_cut():
    """A following stream's windows, of any sizes (0 included), split by continued_shares:
    each window's shares tile it, and after every window the processes' counts are the
    epoch so far divided as evenly as it goes, the first processes one more."""
    from actx.reader import shuffle

    rng = np.random.default_rng(3)
    for processes in (1, 2, 3, 8):
        held, before = np.zeros(processes, np.int64), 0
        for tokens in rng.integers(0, 40, 60).tolist():
            bounds = shuffle.continued_shares(before, tokens, processes)
            assert bounds[0] == 0 and bounds[-1] == tokens and (np.diff(bounds) >= 0).all()
            held, before = held + np.diff(bounds), before + tokens
            q, r = divmod(before, processes)
            assert held.tolist() == [q + (p < r) for p in range(processes)]

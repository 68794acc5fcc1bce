"""reader.torch_data: a DataLoader with several workers in several processes reads every
kept token once per epoch, resumes where it stopped, and the reader never imports torch
unless asked."""

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from actx import reader  # noqa: E402
from actx.reader import torch_data  # noqa: E402
from tests import reader_fixtures as rf  # noqa: E402

HOOK = "layers.0.resid_post"
T = 16


def _run(tmp_path, **kwargs) -> rf.RunTruth:
    return rf.build_run(str(tmp_path / "run"), num_partitions=4, partition_rows=8,
                        rows_per_shard=4, committed=(0, 1, 2, 3), dtype="bfloat16", **kwargs)


def _loader(dataset, workers=2):
    return dataset.loader(workers)


def test_two_workers_in_two_processes_cover_every_kept_token_once(tmp_path):
    truth = _run(tmp_path)
    seen = []
    for rank in (0, 1):  # two training processes, each with a DataLoader of two workers
        ds = torch_data.ActivationDataset(truth.uri, HOOK, 7, rank=rank, world_size=2,
                                          drop_last=False, with_tokens=True,
                                          exclude=["bos"], buffer_tokens=4 * T, block_rows=4)
        for acts, tokens in _loader(ds):
            assert acts.dtype == torch.float32 and acts.shape[1] == truth.hidden
            rows, cols = tokens["rows"].numpy(), tokens["cols"].numpy()
            np.testing.assert_array_equal(
                acts.numpy(), truth.value(HOOK, rows, cols).astype(np.float32))
            seen.append(rows * T + cols)
    seen = np.concatenate(seen)
    ids = truth.tokens["input_ids"]
    first = np.zeros(ids.shape, bool)
    for d in truth.docs:
        first[d["first_row"], d["first_col"]] = True
    want = np.flatnonzero(truth.committed_mask() & ~first & (ids != rf.BOS_ID))
    assert len(seen) == len(want)  # no token twice
    assert np.array_equal(np.sort(seen), want)


def test_resume_continues_each_workers_stream(tmp_path):
    truth = _run(tmp_path)
    kwargs = dict(rank=1, world_size=2, epochs=2, with_tokens=True, buffer_tokens=4 * T,
                  block_rows=4)

    def flat(items):
        return [(t["rows"] * T + t["cols"]).numpy() for _, t in items]

    whole = flat(_loader(torch_data.ActivationDataset(truth.uri, HOOK, 5, **kwargs)))
    assert len(whole) > 8
    ds = torch_data.ActivationDataset(truth.uri, HOOK, 5, **kwargs)
    head = []
    for item in _loader(ds):
        head.append(item)
        if len(head) == 5:
            break
    state = ds.state_dict(len(head))
    resumed = torch_data.ActivationDataset(truth.uri, HOOK, 5, resume=state, **kwargs)
    got = flat(head) + flat(_loader(resumed))
    assert len(got) == len(whole)
    for a, b in zip(got, whole):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="resume: a state of other settings"):
        torch_data.ActivationDataset(truth.uri, HOOK, 6, resume=state, **kwargs)


def test_in_process_iteration_yields_dicts_for_several_hooks_on_a_device(tmp_path):
    truth = _run(tmp_path)
    ds = torch_data.ActivationDataset(reader.open_run(truth.uri), list(truth.hooks), 16,
                                      device="cpu", dtype=torch.float64, with_tokens=True)
    n = 0
    for acts, tokens in ds:
        assert set(acts) == set(truth.hooks) and acts["embed"].dtype == torch.float64
        rows, cols = tokens["rows"].numpy(), tokens["cols"].numpy()
        np.testing.assert_array_equal(acts["embed"].numpy(), truth.value("embed", rows, cols))
        n += len(rows)
    assert n == truth.committed_mask().sum() // 16 * 16


def test_the_reader_does_not_import_torch(tmp_path):
    truth = _run(tmp_path)
    code = ("import sys, actx; r = actx.open_run(sys.argv[1]); "
            "[b for b in r.stream('embed', 8)]; r.select('embed', exclude=['bos']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code, truth.uri], check=True)


def test_the_dataset_follows_a_live_run_in_its_workers(tmp_path):
    """follow=True in two spawned DataLoader workers: each follows the run's commits for
    its own share, and together they read every token once."""
    import threading
    import time

    truth = rf.build_run(str(tmp_path / "run"), num_partitions=4, partition_rows=8,
                         rows_per_shard=4, committed=(0,), dtype="bfloat16")

    def commit_later():
        for p in (2, 1, 3):
            time.sleep(0.5)
            rf.commit_partition(truth, p)

    writer = threading.Thread(target=commit_later, daemon=True)
    ds = torch_data.ActivationDataset(truth.uri, HOOK, 7, rank=0, world_size=1,
                                      drop_last=False, with_tokens=True, follow=True,
                                      window_partitions=1, poll_s=0.05, wait_timeout_s=120,
                                      buffer_tokens=4 * T, block_rows=4)
    seen = []
    for acts, tokens in _loader(ds):
        rows, cols = tokens["rows"].numpy(), tokens["cols"].numpy()
        np.testing.assert_array_equal(acts.numpy(),
                                      truth.value(HOOK, rows, cols).astype(np.float32))
        seen.append(rows * T + cols)
        if not writer.is_alive() and len(truth.committed) == 1:
            writer.start()  # the workers read partition 0 and wait: the rest commits now
    writer.join()
    seen = np.concatenate(seen)
    assert len(truth.committed) == 4
    assert np.array_equal(np.sort(seen), np.flatnonzero(truth.committed_mask()))

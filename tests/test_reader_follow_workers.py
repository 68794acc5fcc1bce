"""A trainer follows a real 2-host local run from processes of its own
(tests.follow_probe): one stops mid-stream and saves its state; a second resumes from it
while a worker is killed (SIGKILL, no last heartbeat), waits saying why (the dead host,
status's advice), and finishes once `actx rerun` completes the run. Between them every
valid token of the run is read exactly once, with the run's own activations. A tiny
random Qwen2 on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

import actx
from actx.schemas import commit, store
from tests import hf_models, token_runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOK = "layers.0.resid_post"
ENV = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}


def _start(*args, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env={**ENV, **(env or {})},
                            text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _follower(out, run, options) -> subprocess.Popen:
    return _start("tests.follow_probe", str(out), run, HOOK, "32", json.dumps(options))


def _done(proc: subprocess.Popen, out, timeout=300) -> dict:
    text, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, text
    with open(out) as f:
        return json.load(f)


def test_follower_across_a_killed_worker_and_a_rerun_reads_every_token_once(tmp_path):
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=1)
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, str(model), n_rows=128, seq_len=32, partition_rows=8,
                               rows_per_shard=4)
    s = store.open_store(run)
    n = len(actx.open_run(run).partitions)
    options = dict(window_partitions=2, poll_s=0.2, stall_s=1.0, wait_timeout_s=240, settle_s=1.0,
                   buffer_tokens=256, block_rows=4, seed=3)
    cfg = tmp_path / "t.yaml"
    cfg.write_text("target:\n  heartbeat_s: 1\n")
    # The trainer starts before any partition commits: it waits for the first window.
    first = _follower(tmp_path / "a.json", run, dict(options, stop_after=4))
    # Each host's worker is killed (SIGKILL: no last heartbeat) as it is about to commit
    # its third partition: the run stops with 4 of its 16 partitions committed.
    job = _start("actx.deploy.cli", "rerun", run, "--config", str(cfg), "--hosts", "2",
                 "--batch-size", "8", "--job", "first", env={"ACTX_CRASH_AT": "before_commit:3"})
    a = _done(first, tmp_path / "a.json")
    assert a["steps"] == [0, 1, 2, 3] and a["state"]["next_step"] == 4
    # The second trainer resumes from the first one's state while the run is broken.
    second = _follower(tmp_path / "b.json", run, dict(options, resume=a["state"]))
    text, _ = job.communicate(timeout=300)
    assert job.returncode != 0 and "killed by SIGKILL" in text, text
    assert len(commit.committed_partitions(s)) == 4
    # The follower waits, and says why (as it says it: the probe's log) before the rerun.
    log = tmp_path / "b.json.log"
    deadline = time.monotonic() + 120
    while "phase failed" not in (log.read_text() if log.exists() else ""):
        assert second.poll() is None and time.monotonic() < deadline, second.communicate()
        time.sleep(0.1)
    rerun = subprocess.run([sys.executable, "-m", "actx.deploy.cli", "rerun", run, "--config",
                            str(cfg), "--hosts", "2", "--batch-size", "8", "--job", "second"],
                           cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    b = _done(second, tmp_path / "b.json")

    # It waited, naming the dead host and quoting status's advice.
    said = [w for w in b["waits"] if "phase failed" in w][-1]
    assert "(4 of 16 partitions committed" in said, said
    assert "dead hosts: local-r0h0 failed (process killed by SIGKILL" in said, said
    assert "; local-r1h0 failed (process killed by SIGKILL" in said, said
    assert f"status says: a worker failed (its reason is in the hosts table): `actx rerun {run}`" \
        f" after a fix" in said
    # The resumed stream goes on at the next step, in the recorded order plus what
    # committed since; its first epoch ends when the run is complete.
    assert b["steps"] == list(range(4, 4 + len(b["steps"])))
    assert b["commit_order"][:len(a["commit_order"])] == a["commit_order"]
    assert sorted(b["commit_order"]) == list(range(n))
    assert b["first_epoch_steps"] == b["steps"][-1] + 1 and set(b["epochs"]) == {0}
    # Counted against the run: every valid token exactly once, over the two trainers,
    # and the activations they got are the run's.
    finished = actx.open_run(run)
    seg = finished.token_array("segment_ids")[:].read().result()
    rows, cols = np.nonzero(seg > 0)
    tokens = np.asarray(a["tokens"] + b["tokens"])
    np.testing.assert_array_equal(np.sort(tokens), np.sort(rows * finished.seq_len + cols))
    acts = finished.gather([HOOK], tokens // finished.seq_len, tokens % finished.seq_len)[HOOK]
    np.testing.assert_allclose(sum(a["sums"]) + sum(b["sums"]),
                               acts.astype(np.float64).sum(), rtol=1e-9)

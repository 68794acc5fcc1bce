"""The slurm target against a real Slurm: Debian's slurm-wlm with two nodes (`slurmd -N
actx-n1`, `-N actx-n2`) on this machine, started by tests/slurm_cluster.sh (.ci/run does it;
without it these tests skip and say why). Real sbatch, srun, squeue, scancel and scontrol:
node names the JAX coordinator must resolve, a killed task that ends the job FAILED, a
node set DOWN, no accounting (no sacct).

  - `submit --wait` on 2 nodes: byte-identical to a local run; each rank's figures in
    status are its own;
  - a task killed mid-run, then the advice status prints followed as printed: the rerun
    stays on Slurm and completes with no partition extracted twice;
  - `actx down` cancels a running job;
  - the advice a detached job prints, each followed as printed: `actx down` stops it, the
    rerun on Slurm the follower names resumes it, `actx status --watch` follows that to
    the end, and `actx verify` passes; a rerun the run refuses after its command ended
    leaves the launch record the plain rerun follows as it was;
  - a node set DOWN mid-run: the job ends, and the advice finishes the run once the node
    is back.

What one machine cannot show (a node's own processes dying with it, NODE_FAIL, sacct)
stays with the simulated cluster (tests/test_slurm_target.py).
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import signal
import subprocess
import threading
import time
import uuid

import pytest

from actx.deploy import cli, launch_record
from actx.deploy.targets.slurm import plan
from actx.schemas import job_lease, store
from tests import real_slurm, slurm_configs
from tests.advice_follow import follow

pytestmark = pytest.mark.real_slurm

NODES = 2


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """The running cluster (skips without one); the tests' environment reaches it (the
    jobs inherit it: sbatch exports this environment, ACTX_CHECKOUT included)."""
    monkeypatch.setenv("SLURM_CONF", real_slurm.cluster())
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the nodes' ~/actx-logs
    names = []  # the test's job names: what a failed test left running is cancelled
    yield names
    for name in names:
        subprocess.run(["scancel", f"--name={name}"], capture_output=True, timeout=60)


def _name(cluster: list) -> str:
    cluster.append(f"actx-{uuid.uuid4().hex[:6]}")
    return cluster[-1]


@pytest.fixture
def config(cluster, tmp_path, qwen_tokenizer_dir):
    """A run long enough to be interrupted: 3000 documents, 160 partitions (the 2-node
    job extracts 10 in half a second once its step is compiled)."""
    return slurm_configs.write(tmp_path, qwen_tokenizer_dir, _name(cluster), NODES, docs=3000)


def _main(argv) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(argv, out=out)
    return code, out.getvalue()


def _wait_for(what: str, predicate, timeout: float = 240.0, every: float = 0.2, seen=None):
    """`predicate()`'s first truthy value; on timeout, what `seen()` says of the state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}" + (f": {seen()}" if seen else ""))


def _hosts_and_logs(run: str, job: str) -> str:
    """Each host's state as status gives it, and the end of each host's log."""
    s = store.open_store(run)
    logs = {k: s.read(k).decode(errors="replace")[-1500:] for k in s.list(f"logs/{job}/")}
    return json.dumps({"hosts": _status(run)["hosts"], "logs": logs}, indent=1)


def _objects(s, prefix: str) -> dict[str, bytes]:
    return {k: s.read(k) for k in s.list(prefix)}


def _status(run: str, *flags: str) -> dict:
    code, out = _main(["status", run, "--json", *flags])
    assert code == 0, out
    return json.loads(out)


def _squeue(name: str) -> str:
    return subprocess.run(["squeue", "--noheader", f"--name={name}", "--format=%i %T"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def _committed(s) -> set[int]:
    return {int(k.split("-")[1].split(".")[0]) for k in s.list("commits/")}


def _same_as_local(tmp_path, cfg: dict, s) -> None:
    """The run's activations are byte for byte a local run's of the same spec."""
    path, local_cfg = slurm_configs.write_local(tmp_path, cfg, NODES)
    code, out = _main(["submit", path])
    assert code == 0, out
    ours = _objects(s, "activations/")
    ref = _objects(store.open_store(local_cfg["run"]), "activations/")
    ours.pop("activations/actx.json"), ref.pop("activations/actx.json")
    assert ours.keys() == ref.keys() and ours
    assert [k for k in ours if ours[k] != ref[k]] == []


def _advised_rerun(run: str) -> list[str]:
    """The `actx rerun ...` command `actx status RUN` advises, as printed."""
    code, text = _main(["status", run])
    assert code == 0, text
    commands = re.findall(r"`(actx rerun [^`]*)`", text)
    assert commands, text
    assert len(set(commands)) == 1, commands
    return shlex.split(commands[0])


def _worker_pid(run: str, host: str) -> int:
    beat = store.open_store(run).read_json(f"workers/{host}.json")
    return beat["pid"]


def test_submit_wait_on_two_nodes_is_byte_identical_to_local(cluster, tmp_path,
                                                              qwen_tokenizer_dir):
    # One shard per partition: rank 1 stores no row, and still reports what it did.
    path, cfg = slurm_configs.write(tmp_path, qwen_tokenizer_dir, _name(cluster), NODES,
                                    rows_per_shard=8)
    run, name = cfg["run"], cfg["target"]["slurm"]["name"]
    code, out = _main(["submit", path, "--wait"])
    assert code == 0, out
    s = store.open_store(run)
    n = len(s.read_json("manifest.json")["partitions"]["id"])
    assert _committed(s) == set(range(n))
    _wait_for("the job to end", lambda: _squeue(name) == "", timeout=120)
    _each_rank_reports_its_own_work(run, name, s, shard=8)
    code, out = _main(["verify", run])
    assert code == 0, out
    _same_as_local(tmp_path, cfg, s)


def _each_rank_reports_its_own_work(run: str, name: str, s, shard: int) -> None:
    """Once the replica finished, each rank's figures are its own, counted here from the
    stored rows: the tokens of the rows of its shards (of 8-row partitions in shards of
    `shard` rows, 4 or 8: rank 0 has the first shard, rank 1 the second if any), and no
    rank is still "warming up"."""
    manifest = s.read_json("manifest.json")
    rows = manifest["partitions"]
    per_row = _tokens_per_row(run)
    mine = {0: 0, 1: 0}
    for start, count in zip(rows["row_start"], rows["row_count"]):
        for row in range(start, start + count):
            mine[0 if row - start < shard else 1] += per_row[row]
    st = _status(run)
    hosts = {h["host"]: h for h in st["hosts"]}
    assert sorted(hosts) == [f"{name}-r0h{i}" for i in range(NODES)]
    for rank in range(NODES):
        h = hosts[f"{name}-r0h{rank}"]
        assert h["state"] == "done" and h["rank"] == rank, h
        assert h["tokens_done"] == mine[rank], (h, mine)
        assert "warming up" not in h["message"] and "compiling" not in h["message"], h
    code, text = _main(["status", run])
    line = text.split(f"{name}-r0h1", 1)[1].split("did: ", 1)[1].splitlines()[0]
    assert line.startswith(f"{mine[1]:,} tokens in its shards (rank 1 of its replica; "
                           f"rank 0 commits"), line


def _tokens_per_row(run: str) -> list[int]:
    """Each stored row's tokens (its non-padding positions), read with actx's reader."""
    from actx import reader

    opened = reader.open_run(run)
    seg = opened.token_rows("segment_ids", 0, opened.total_rows)
    return [int(n) for n in (seg > 0).sum(axis=1)]


def test_killed_task_then_the_advice_as_printed_completes_without_duplicates(config,
                                                                              tmp_path):
    path, cfg = config
    run, name = cfg["run"], cfg["target"]["slurm"]["name"]
    code, out = _main(["submit", path, "--job", "k1"])
    assert code == 0, out
    s = store.open_store(run)
    n = len(s.read_json("manifest.json")["partitions"]["id"])
    _wait_for("a first commit", lambda: _committed(s), every=0.05)
    # kill -9 of rank 1's worker: srun --kill-on-bad-exit ends the step, Slurm the job.
    os.kill(_worker_pid(run, f"{name}-r0h1"), signal.SIGKILL)
    _wait_for("the job to end", lambda: _squeue(name) == "", timeout=120)
    before = _committed(s)
    assert len(before) < n, "the task was killed too late"
    markers_before = _objects(s, "commits/")
    st = _status(run, "--stale-after", "3")
    assert st["phase"] == "failed", st

    argv = _advised_rerun(run)
    assert argv[:3] == ["actx", "rerun", run], argv
    # The live page advises the same command.
    from actx.deploy.page import data as page_data
    from actx.deploy.status import runstate
    from actx.schemas import run_dir

    page = page_data.page_commands(runstate.compute_status(run_dir.open_run(run)))
    assert shlex.split(page["rerun_all"]) == argv, page
    code, out = follow(_main(["status", run])[1], "rerun", "--job", "k2")
    assert code == 0, out
    assert "another job is extracting" not in out
    assert "on slurm" in out, out
    _wait_for("the rerun to commit every partition", lambda: _committed(s) == set(range(n)))
    _wait_for("the rerun's job to end", lambda: _squeue(name) == "", timeout=120)
    # No duplicate: the rerun extracted only what had no commit; earlier markers unchanged.
    assert {k: v for k, v in _objects(s, "commits/").items() if k in markers_before} == \
        markers_before
    script = open(plan.script_path("k2")).read()
    srun = shlex.split(script.splitlines()[-1])
    assert sorted(map(int, srun[srun.index("--only") + 1].split(","))) == \
        sorted(set(range(n)) - before)
    st = _status(run)
    assert st["phase"] == "finished"
    assert {h["host"] for h in st["hosts"]} == {f"{name}-r0h{i}" for i in range(NODES)}
    code, out = _main(["verify", run])
    assert code == 0, out
    _same_as_local(tmp_path, cfg, s)


def test_down_cancels_a_running_job(config):
    path, cfg = config
    run, name = cfg["run"], cfg["target"]["slurm"]["name"]
    # The coordinator by its NodeAddr (127.0.0.1 in this cluster), not its node name.
    code, out = _main(["submit", path, "--job", "d1", "--set",
                       "target.slurm.coordinator=node_addr"])
    assert code == 0, out
    s = store.open_store(run)
    # Extracting (a worker still loading may sit in a collective with its peer, where no
    # signal reaches Python: Slurm's SIGKILL after KillWait ends it, and its heartbeat goes
    # stale instead of saying "stopped").
    _wait_for("a first commit", lambda: _committed(s), every=0.05)
    port = cfg["target"]["slurm"]["coordinator_port"]
    _wait_for("rank 1's log naming the coordinator", lambda: f"JAX distributed service on "
              f"127.0.0.1:{port}" in s.read(f"logs/d1/{name}-r0h1.log").decode(), timeout=30)
    assert "RUNNING" in _squeue(name)
    code, out = _main(["down", "--config", path])
    assert code == 0, out
    _wait_for("the job gone from squeue", lambda: _squeue(name) == "", timeout=60)
    assert job_lease.read(s) is None and "job lease of job d1" in out
    # Slurm's SIGTERM reached the workers (not JAX's preemption handler): each stopped at
    # a step boundary and said so, before KillWait's SIGKILL.
    hosts = _wait_for("both workers stopped", lambda: [
        h for h in _status(run)["hosts"] if h["state"] == "stopped"] if all(
        h["state"] == "stopped" for h in _status(run)["hosts"]) else None, timeout=60,
        seen=lambda: _hosts_and_logs(run, "d1"))
    assert len(hosts) == NODES


def test_detached_advice_as_printed_stops_resumes_and_finishes_the_run(config):
    """Each command a detached Slurm job's output advises, followed as printed: submit
    --wait says how to stop the job; stopped once it extracts, its follower names the
    partitions left and the rerun on Slurm that redoes them; that rerun, detached, says
    how to follow it, which follows it to the end; then status's verify passes."""
    path, cfg = config
    run, name = cfg["run"], cfg["target"]["slurm"]["name"]
    s = store.open_store(run)
    out, ended = io.StringIO(), {}
    waiting = threading.Thread(target=lambda: ended.setdefault("code", cli.main(
        ["submit", path, "--job", "a1", "--wait"], out=out)))
    waiting.start()
    try:
        _wait_for("a first commit", lambda: _committed(s), every=0.05)
        _wait_for("how the job stops", lambda: "cancel it: actx down" in out.getvalue())
        code, said = follow(out.getvalue(), "down")
        assert code == 0 and "job lease of job a1" in said, said
    finally:
        waiting.join(timeout=300)
    n = len(s.read_json("manifest.json")["partitions"]["id"])
    assert ended["code"] == 1 and len(_committed(s)) < n, out.getvalue()
    _wait_for("the job gone from squeue", lambda: _squeue(name) == "", timeout=60)
    stopped = out.getvalue()
    assert f"--target slurm --config {path}` redoes them" in stopped, stopped
    # A rerun the run refuses (another batch size: other rows per device than its
    # numerics record), which its workers find out after the command ended: the launch
    # record the plain rerun follows is still the job's before it (deploy.launch_record).
    code, said = _main(["rerun", run, "--batch-size", "8", "--job", "bad"])
    assert code == 0 and "workers are running as Slurm job" in said, said
    _wait_for("the workers' refusal", lambda: any(
        h["state"] == "refused" for h in _status(run)["hosts"]), timeout=180)
    _wait_for("the refused job gone from squeue", lambda: _squeue(name) == "", timeout=120)
    recorded = launch_record.read(s)
    assert (recorded["job"], recorded["batch_size"]) == ("a1", 4), recorded

    code, said = follow(stopped, "rerun_on", "--job", "a2")
    assert code == 0 and "workers are running as Slurm job" in said, said
    code, watched = follow(said, "watch")  # returns once every partition is committed
    assert code == 0 and watched.rstrip().splitlines()[0].startswith("run "), watched
    assert _committed(s) == set(range(n)) and "phase:      finished" in watched, watched
    _wait_for("the rerun's job to end", lambda: _squeue(name) == "", timeout=120)
    code, said = follow(_main(["status", run])[1], "verify")
    assert code == 0 and "OK: every committed block matches its checksum" in said, said


def test_a_node_set_down_mid_run_then_the_advice_finishes_the_run(config, tmp_path):
    path, cfg = config
    run, name = cfg["run"], cfg["target"]["slurm"]["name"]
    code, out = _main(["submit", path, "--job", "n1"])
    assert code == 0, out
    s = store.open_store(run)
    n = len(s.read_json("manifest.json")["partitions"]["id"])
    _wait_for("a first commit", lambda: _committed(s), every=0.05)
    node = real_slurm.NODES[1]
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=down",
                    "reason=actx test"], check=True, capture_output=True, timeout=60)
    try:
        # The job ends (sbatch --no-requeue): pending for a requeue, it would hold the run.
        _wait_for("the job to end", lambda: _squeue(name) == "", timeout=120)
        assert len(_committed(s)) < n, "the node went down too late"
    finally:
        # Back to service (ReturnToService=2 may have done it already, when its slurmd
        # answered: then scontrol refuses the transition, which is no failure).
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"],
                       capture_output=True, timeout=60)
    _wait_for("the node back", lambda: subprocess.run(
        ["sinfo", "--noheader", "-n", node, "-o", "%t"], capture_output=True, text=True,
        timeout=60).stdout.strip() == "idle", timeout=60)
    st = _status(run, "--stale-after", "3")
    assert st["phase"] in ("failed", "stopped") and st["counts"]["committed"] < n, st
    markers_before = _objects(s, "commits/")
    code, out = _main(_advised_rerun(run)[1:] + ["--wait", "--job", "n2"])
    assert code == 0, out
    assert _committed(s) == set(range(n))
    assert {k: v for k, v in _objects(s, "commits/").items() if k in markers_before} == \
        markers_before
    code, out = _main(["verify", run])
    assert code == 0, out

    # `verify --repair`'s advice reruns on Slurm too: a damaged chunk (p-00002's rows, as
    # a bad disk would leave them) made pending, then extracted again by the command it
    # prints, as printed.
    _damage_chunk(run, row_start=16)
    code, out = _main(["verify", run, "--repair"])
    assert code == 1 and "REPAIRED: 1 partition(s)" in out, out
    [advice] = re.findall(r"`(actx rerun [^`]*)`", out)
    code, out = _main(shlex.split(advice)[1:] + ["--wait", "--job", "n3"])
    assert code == 0 and "on slurm" in out, out
    code, out = _main(["verify", run])
    assert code == 0, out


def _damage_chunk(run: str, row_start: int) -> None:
    """Flips a byte of the first hook's stored chunk that starts at `row_start`."""
    from actx.schemas import layout

    root = os.path.join(run, layout.ACTIVATIONS_GROUP)
    hook = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))[0]
    info = store.open_store(run).read_json(f"{layout.ACTIVATIONS_GROUP}/{hook}/zarr.json")
    rows = info["chunk_grid"]["configuration"]["chunk_shape"][0]
    with open(os.path.join(root, hook, "c", str(row_start // rows), "0", "0"), "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0xFF
        f.seek(0)
        f.write(data)

"""The slurm target through the CLI, against a simulated cluster (tests/fake_slurm.py):
submit an array whose job step joins two "nodes" with jax.distributed from Slurm's
environment, lose a node half way (the step fails, the task ends NODE_FAIL), see its
partitions stale, rerun only the missing ones, verify, compare with a local run byte for
byte; and `actx down` cancels a running job (scancel) and gives the run back.

The nodes run the real `python -m actx.workers.main` on CPU, as the Slurm target starts
them: `srun python -m actx.deploy.targets.slurm.step ... -- python -m actx.workers.main ...`.
"""

from __future__ import annotations

import dataclasses
import getpass
import io
import json
import os
import shlex
import time
import uuid

import pytest

from actx.deploy import cli
from actx.deploy.targets.slurm import step
from actx.schemas import job_lease, layout, store
from tests import slurm_configs
from tests.fake_slurm import FakeSlurm

NODES = 2


def _main(argv) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(argv, out=out)
    return code, out.getvalue()


def _wait_for(what: str, predicate, timeout: float = 240.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def _objects(s, prefix: str) -> dict[str, bytes]:
    return {k: s.read(k) for k in s.list(prefix)}


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    sim = FakeSlurm(str(tmp_path / "slurm"))
    bin_dir = str(tmp_path / "bin")
    sim.install(bin_dir)
    monkeypatch.setenv("PATH", bin_dir + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the nodes' ~/actx-logs
    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    try:
        yield sim
    finally:
        sim.kill_all()


@pytest.fixture
def slurm_config(tmp_path, qwen_tokenizer_dir):
    return slurm_configs.write(tmp_path, qwen_tokenizer_dir, "actx-t", NODES, partition="gpu",
                               account="lab", time="00:30:00")


def test_first_host_and_placement_from_slurms_environment():
    assert step.first_host("gpu[003-005,9],cpu1") == "gpu003"
    assert step.first_host("r[1-2]n[01-04]") == "r1n01"
    assert step.first_host("node7") == "node7"
    env = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_PROCID": "1", "SLURM_NTASKS": "4",
           "SLURM_STEP_NODELIST": "a[10-13]", "SLURM_JOB_NODELIST": "b[1-9]"}
    assert step.placement(env, "x", 9000) == {
        "replica": 3, "host_name": "x-r3h1", "coordinator": "a10:9003", "num_processes": 4,
        "process_id": 1}
    assert step.placement({}, "x", 9000) == {"replica": 0, "host_name": "x-r0h0"}


def test_sbatch_flags_and_a_nodes_devices_from_gres():
    from actx.deploy import config
    from actx.deploy.targets.slurm import plan
    from actx.deploy.targets.slurm.settings import SlurmConfig

    slurm = SlurmConfig(name="x", replicas=3, nodes=2, partition="p", account="a", qos="q",
                        time="1:00:00", gres="gpu:a100:8", constraint="h100", mem="0",
                        cpus_per_task=16, sbatch_args=("--exclusive",), output_dir="/o")
    assert plan.sbatch_flags(slurm, "j") == [
        "--job-name=x", "--array=0-2", "--nodes=2", "--ntasks-per-node=1", "--no-requeue",
        "--output=/o/%x-%A_%a.out", "--partition=p", "--account=a", "--qos=q",
        "--time=1:00:00", "--gres=gpu:a100:8", "--constraint=h100", "--mem=0",
        "--cpus-per-task=16", "--exclusive"]
    assert plan.devices_per_node(slurm) == 8
    assert plan.host_names(slurm) == ["x-r0h0", "x-r0h1", "x-r1h0", "x-r1h1", "x-r2h0",
                                      "x-r2h1"]
    # 2 nodes x 8 GPUs: a batch of 8 leaves devices idle, 32 splits.
    target = config.TargetConfig(kind="slurm", batch_size=8, slurm=slurm)
    [problem] = plan.problems("/shared/run", target)
    assert problem.startswith("target.batch_size: ") and "16" in problem, problem
    assert plan.problems("/shared/run", dataclasses.replace(target, batch_size=32)) == []
    assert plan.problems("runs/r", dataclasses.replace(target, batch_size=32)) == [
        "run 'runs/r': the nodes need a run directory they can reach: a gs:// URI or an "
        "absolute path on a filesystem they share"]


def test_bad_settings_are_refused_before_anything_is_submitted(slurm_config, fake_slurm,
                                                                capsys):
    path, _ = slurm_config
    code, _ = _main(["submit", path, "--set", "target.batch_size=3",
                     "--set", "target.slurm.name=bad name"])
    out = capsys.readouterr().err
    assert code == 2, out
    assert "target.slurm.name: 'bad name'" in out and "target.batch_size: 3" in out, out
    assert fake_slurm.calls() == []


def test_node_dies_status_shows_it_rerun_finishes_byte_identical(slurm_config, fake_slurm,
                                                                tmp_path):
    path, cfg = slurm_config
    run = cfg["run"]
    job = f"s1-{uuid.uuid4().hex[:6]}"
    code, dry = _main(["submit", path, "--job", job, "--dry-run"])
    assert code == 0, dry
    assert fake_slurm.calls() == [] and not os.path.exists(run)
    code, out = _main(["submit", path, "--job", job])
    assert code == 0, out
    assert "workers are running as Slurm job actx-t, detached" in out
    # sbatch got exactly the argv the dry run printed, with the array and the cluster's
    # flags; the script it ran is the one the dry run showed.
    planned = [line for line in dry.splitlines() if line.startswith("sbatch ")]
    assert [shlex.join(c) for c in fake_slurm.calls() if c[0] == "sbatch"] == planned
    sbatch = fake_slurm.calls()[0]
    for flag in ("--array=0-0", f"--nodes={NODES}", "--partition=gpu", "--account=lab",
                 "--time=00:30:00", "--job-name=actx-t", "--ntasks-per-node=1"):
        assert flag in sbatch, sbatch
    lines = dry.splitlines()
    at = lines.index(f"# {sbatch[-1]}:") + 1
    shown = []
    while lines[at].startswith("#   "):
        shown.append(lines[at][4:])
        at += 1
    assert open(sbatch[-1]).read().splitlines() == shown
    assert any(line.startswith("srun --kill-on-bad-exit=1 ") for line in shown)

    s = store.open_store(run)
    n = len(s.read_json("manifest.json")["partitions"]["id"])
    assert n >= 6, f"the test needs partitions to lose ({n})"
    hosts = [f"actx-t-r0h{i}" for i in range(NODES)]

    def committed() -> set[int]:
        return {int(k.split("-")[1].split(".")[0]) for k in s.list("commits/")}

    def all_hosts_beating():
        st = json.loads(_main(["status", run, "--json"])[1])
        return st if sum(h["live"] for h in st["hosts"]) == NODES else None

    st = _wait_for("every node's heartbeat", all_hosts_beating)
    assert sorted(h["host"] for h in st["hosts"]) == hosts
    lease = job_lease.read(s)
    assert lease.job == job and lease.detached and list(lease.hosts) == hosts
    _wait_for("a first commit", lambda: len(committed()) >= 1, every=0.05)
    fake_slurm.kill_node(f"{sbatch_job(fake_slurm)}_0", 1)  # node 1 dies
    done_before = committed()
    assert len(done_before) < n, "the node died too late"
    first = sbatch_job(fake_slurm)
    _wait_for("the task to end", lambda: [line.split("|")[:2] for line in _sacct(first)]
              == [[f"{first}_0", "NODE_FAIL"]], timeout=30)
    assert fake_slurm.live_pids() == []  # --kill-on-bad-exit ended the other node too
    assert _squeue() == ""

    time.sleep(3.5)
    code, out = _main(["status", run, "--json", "--stale-after", "3"])
    st = json.loads(out)
    assert not any(h["live"] for h in st["hosts"]), st["hosts"]
    done_before = committed()
    missing = sorted(set(range(n)) - done_before)
    assert missing and [p for p, v in st["partitions"].items() if v != "committed"] == \
        [layout.partition_name(p) for p in missing]
    held = {h["partition"] for h in st["hosts"] if h["partition"] is not None} - done_before
    assert all(st["partitions"][layout.partition_name(p)] == "stale" for p in held)
    assert sorted(s.list(f"logs/{job}/")) == [f"logs/{job}/{h}.log" for h in hosts]
    markers_before = _objects(s, "commits/")

    # The dead job's lease is taken over at once: Slurm runs none of its tasks.
    code, out = _main(["rerun", run, "--target", "slurm", "--config", path, "--wait",
                       "--job", "s2"])
    assert code == 0, out
    assert "another job is extracting" not in out
    script = [c for c in fake_slurm.calls() if c[0] == "sbatch"][-1][-1]
    srun = shlex.split(open(script).read().splitlines()[-1])
    assert srun[srun.index("--only") + 1] == ",".join(map(str, missing))
    assert committed() == set(range(n))
    assert {k: v for k, v in _objects(s, "commits/").items() if k in markers_before} == \
        markers_before
    code, out = _main(["verify", run])
    assert code == 0, out

    # Byte-identical to a local run of the same spec (one process with both nodes'
    # devices: the same rows per device).
    local_path, local_cfg = slurm_configs.write_local(tmp_path, cfg, NODES)
    code, out = _main(["submit", local_path])
    assert code == 0, out
    local = store.open_store(local_cfg["run"])
    ours, ref = _objects(s, "activations/"), _objects(local, "activations/")
    ours.pop("activations/actx.json"), ref.pop("activations/actx.json")
    assert ours.keys() == ref.keys() and len(ours) > n
    assert [k for k in ours if ours[k] != ref[k]] == []


def sbatch_job(sim: FakeSlurm) -> str:
    return sorted(sim.read()["jobs"])[0]


def _sacct(job: str) -> list[str]:
    import subprocess

    return subprocess.run(["sacct", "-j", job, "--noheader", "--parsable2",
                           "--format=JobID,State,ExitCode"], capture_output=True, text=True,
                          check=True).stdout.split()


def _squeue() -> str:
    import subprocess

    return subprocess.run(["squeue", "--noheader", "--format=%i %T"], capture_output=True,
                          text=True, check=True).stdout.strip()


def test_down_cancels_the_job_and_gives_the_run_back(slurm_config, fake_slurm, capsys):
    path, cfg = slurm_config
    run = cfg["run"]
    code, out = _main(["submit", path, "--job", "c1"])
    assert code == 0, out
    s = store.open_store(run)
    _wait_for("a heartbeat", lambda: any(
        h["live"] for h in json.loads(_main(["status", run, "--json"])[1])["hosts"]))
    assert job_lease.read(s).job == "c1"
    code, _ = _main(["submit", path, "--job", "c2"])  # the run is c1's
    out = capsys.readouterr().err
    assert code == 2 and "c1" in out and "actx down --config" in out, out
    code, out = _main(["down", "--config", path])
    assert code == 0, out
    assert ["scancel", "--name=actx-t", f"--user={getpass.getuser()}"] in fake_slurm.calls()
    job = sbatch_job(fake_slurm)
    _wait_for("the task cancelled", lambda: [line.split("|")[:2] for line in _sacct(job)]
              == [[f"{job}_0", "CANCELLED"]], timeout=30)
    assert fake_slurm.live_pids() == [] and _squeue() == ""
    assert job_lease.read(s) is None and "job lease of job c1" in out


def test_waits_help_names_every_target_it_follows(capsys):
    """`--wait` follows a detached target's workers: its help names each target whose
    class is a DetachedTarget (slurm among them), found here from the classes."""
    import importlib

    from actx.deploy import targets
    from actx.deploy.detached.target import DetachedTarget

    detached = [k.name for k in targets.KINDS.values() if issubclass(
        getattr(importlib.import_module(k.module), k.cls), DetachedTarget)]
    assert "slurm" in detached and "tpu-vm" in detached
    for command in ("submit", "rerun"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        said = text.split("--wait ", 1)[1].split(": follow", 1)[0]
        assert said == " and ".join(detached), said

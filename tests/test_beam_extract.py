"""Extraction as a Beam transform (adapters/beam_extract.py): on Beam's in-process and
multi-process runners it writes the bytes the worker target writes, a DoFn that raises
mid-partition is retried by the runner, and two pipelines over one run commit each
partition once. Real Beam runners, real worker code, a tiny random Qwen2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from actx.schemas import commit, store
from tests import hf_models, token_runs, worker_procs

HOOKS = "embed,layers.*.resid_post,layers.1.mlp_out"
N_ROWS, PARTITION_ROWS = 48, 16  # 3 partitions of 2 steps (batch 8 over 4 devices)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """Extracted by one worker process (the worker target): the reference bytes."""
    model = hf_models.make_tiny_checkpoint(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")
    run = str(tmp_path_factory.mktemp("ref") / "run")
    token_runs.write_token_run(run, str(model), n_rows=N_ROWS, hooks=HOOKS,
                               partition_rows=PARTITION_ROWS)
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "8"])
    assert code == 0, out
    return run


def _start(run: str, job: str, *beam_args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "actx.adapters.beam_extract", "--run", run, "--batch-size", "8",
         "--job", job, *beam_args], env=worker_procs.worker_env(4, **env),
        cwd=worker_procs.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _markers(run: str) -> dict[int, commit.CommitMarker]:
    s = store.open_store(run)
    return {p: commit.read_marker(s, p) for p in commit.committed_partitions(s)}


def _assert_same_as_reference(run: str, reference: str) -> None:
    assert sorted(_markers(run)) == list(range(N_ROWS // PARTITION_ROWS))
    worker_procs.assert_same_activations(run, reference)
    for pid, marker in _markers(run).items():
        assert marker.checksums == _markers(reference)[pid].checksums


@pytest.mark.parametrize("beam_args", [
    ("--runner=FnApiRunner",),
    ("--runner=FnApiRunner", "--direct_num_workers=2", "--direct_running_mode=multi_processing"),
], ids=["in-process", "two-processes"])
def test_transform_writes_the_worker_targets_bytes(reference_run, tmp_path, beam_args):
    run = worker_procs.copy_token_store(reference_run, str(tmp_path / "run"))
    code, out = worker_procs.finish(_start(run, "beam", *beam_args), timeout=600)
    assert code == 0, out
    assert "3 partition(s) given to the pipeline; 0 left uncommitted" in out
    _assert_same_as_reference(run, reference_run)
    hosts = {m.hosts for m in _markers(run).values()}
    assert all(len(h) == 1 for h in hosts)
    # Heartbeats come from the Beam worker processes, and end "done".
    s = store.open_store(run)
    beats = [s.read_json(k) for k in s.list("workers/")]
    assert beats and all(b["host"].startswith("beam-") and b["state"] == "done" for b in beats)
    # A second pipeline finds everything committed and does nothing.
    code, out = worker_procs.finish(_start(run, "again", "--runner=FnApiRunner"))
    assert code == 0 and "0 partition(s) given" in out, out


def test_a_dofn_that_raises_mid_partition_is_retried(reference_run, tmp_path):
    """BundleBasedDirectRunner retries a failed bundle; the failed attempt committed
    nothing, the retry commits once."""
    run = worker_procs.copy_token_store(reference_run, str(tmp_path / "run"))
    code, out = worker_procs.finish(_start(run, "retry", "--runner=BundleBasedDirectRunner",
                                           ACTX_CRASH_AT="step:3:RAISE"), timeout=600)
    assert code == 0, out
    assert "injected failure at step" in out  # it did fail once, mid-partition
    _assert_same_as_reference(run, reference_run)


def test_two_pipelines_at_once_commit_each_partition_once(reference_run, tmp_path):
    run = worker_procs.copy_token_store(reference_run, str(tmp_path / "run"))
    procs = [_start(run, f"twin{i}", "--runner=FnApiRunner") for i in range(2)]
    outs = [worker_procs.finish(p, timeout=600) for p in procs]
    for code, out in outs:
        assert code == 0, out
    _assert_same_as_reference(run, reference_run)
    # Each marker names the one attempt that won; a loser's records say so.
    attempts = {m.attempt for m in _markers(run).values()}
    assert 1 <= len(attempts) <= 2


def test_rerun_with_the_beam_target_then_status_and_verify(reference_run, tmp_path):
    import io

    import yaml

    from actx.deploy import cli

    run = worker_procs.copy_token_store(reference_run, str(tmp_path / "run"))
    cfg = tmp_path / "t.yaml"
    cfg.write_text(yaml.safe_dump({"target": {
        "extract": "beam", "devices_per_host": 4, "batch_size": 8,
        "beam_args": ["--runner=BundleBasedDirectRunner"]}}))
    out = io.StringIO()
    assert cli.main(["rerun", run, "--config", str(cfg), "--job", "b1"], out=out) == 0, \
        out.getvalue()
    assert "through Beam (--runner=BundleBasedDirectRunner)" in out.getvalue()
    _assert_same_as_reference(run, reference_run)
    assert cli.main(["verify", run], out=io.StringIO()) == 0
    assert cli.main(["status", run, "--check"], out=io.StringIO()) == 0
    assert (tmp_path / "run" / "logs" / "b1" / "beam.log").exists()


def test_dataflow_gpu_launch_command_in_dry_run(tmp_path, monkeypatch, capsys):
    import io
    import shlex

    import yaml

    from actx.deploy import cli

    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "run": "gs://b/runs/r1",
        "spec": {"name": "r1", "model": {"path": "gs://b/models/qwen"},
                 "tokenizer": {"path": "gs://b/models/qwen"},
                 "sources": [{"kind": "fineweb", "paths": ["gs://b/fineweb/*.parquet"]}],
                 "packing": {"seq_len": 1024}, "capture": {"hooks": "layers.3.resid_post"}},
        "target": {"kind": "dataflow", "extract": "beam", "batch_size": 16,
                   "dataflow": {"project": "proj", "region": "us-central1",
                                "temp_location": "gs://b/tmp", "max_num_workers": 8,
                                "sdk_container_image": "us-docker.pkg.dev/proj/r/actx-gpu:1",
                                "extract_accelerator":
                                    "type:nvidia-l4;count:1;install-nvidia-driver",
                                "extract_machine_type": "g2-standard-8"}}}))
    out = io.StringIO()
    assert cli.main(["submit", str(cfg), "--dry-run", "--job", "j1"], out=out) == 0, \
        capsys.readouterr().err
    [line] = [l for l in out.getvalue().splitlines() if "actx.adapters.beam_extract" in l]
    argv = shlex.split(line)
    assert argv[:3] == ["python3", "-m", "actx.adapters.beam_extract"]
    for flag in ("--run", "gs://b/runs/r1", "--batch-size", "16", "--job", "j1",
                 "--runner=DataflowRunner", "--project=proj", "--region=us-central1",
                 "--sdk_container_image=us-docker.pkg.dev/proj/r/actx-gpu:1",
                 "--sdk_location=container", "--machine_type=g2-standard-8",
                 "--max_num_workers=8",
                 "--dataflow_service_options=worker_accelerator=type:nvidia-l4;count:1;"
                 "install-nvidia-driver"):
        assert flag in argv, flag
    # The worker flags are the worker's own: `actx extract` would parse them the same way.
    from actx.adapters import beam_extract

    args, beam_flags = beam_extract._parser().parse_known_args(argv[3:])
    assert (args.run, args.batch_size, args.job) == ("gs://b/runs/r1", 16, "j1")
    assert "--runner=DataflowRunner" in beam_flags
    assert not (tmp_path / ".actx").exists()
    # Named extractions: one command, its pipelines one extraction after another, each
    # checked by the workers against its own spec (no root fingerprint to expect).
    out = io.StringIO()
    assert cli.main(["submit", str(cfg), "--dry-run", "--job", "j2",
                     "--set", "extractions.base.model.path=gs://b/models/qwen",
                     "--set", "extractions.chat.model.path=gs://b/models/chat"],
                    out=out) == 0, capsys.readouterr().err
    [line] = [l for l in out.getvalue().splitlines() if "actx.adapters.beam_extract" in l]
    args, _ = beam_extract._parser().parse_known_args(shlex.split(line)[3:])
    assert (args.extraction, args.expect_fingerprint) == ("base,chat", None)


def test_a_worker_killed_mid_partition_leaves_no_marker_and_a_new_pipeline_finishes(
        reference_run, tmp_path):
    """A SIGKILLed Beam worker process (preemption, OOM) takes the in-process runner with it;
    the partition in hand has no marker, and the next pipeline over the run commits it."""
    run = worker_procs.copy_token_store(reference_run, str(tmp_path / "run"))
    code, out = worker_procs.finish(_start(run, "killed", "--runner=FnApiRunner",
                                           ACTX_CRASH_AT="step:3"), timeout=600)
    assert code == -9, out
    done = set(_markers(run))
    assert len(done) < N_ROWS // PARTITION_ROWS  # the partition in hand is not committed
    code, out = worker_procs.finish(_start(run, "again", "--runner=FnApiRunner"), timeout=600)
    assert code == 0, out
    assert f"{N_ROWS // PARTITION_ROWS - len(done)} partition(s) given to the pipeline" in out
    _assert_same_as_reference(run, reference_run)


def test_a_killed_worker_process_of_the_two_process_runner_is_noticed(reference_run, tmp_path):
    """Beam's 2-process local runner waits forever for a worker process that died: the
    process's heartbeat (written before its model loads, naming the partitions it holds)
    shows it dead at once, status calls its partitions stale, `actx rerun` stops with one
    line naming the process and the command that finishes, and that command does, with
    the bytes of the worker target."""
    import io
    import json
    import os
    import signal
    import time

    import yaml

    from actx.deploy import cli
    from actx.schemas import layout

    run = worker_procs.copy_token_store(reference_run, str(tmp_path / "run"))
    cfg = tmp_path / "two.yaml"
    cfg.write_text(yaml.safe_dump({"target": {
        "extract": "beam", "devices_per_host": 4, "batch_size": 8, "heartbeat_s": 1,
        "beam_args": ["--runner=FnApiRunner", "--direct_num_workers=2",
                      "--direct_running_mode=multi_processing"]}}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "actx.deploy.cli", "rerun", run, "--config", str(cfg), "--job",
         "k1"], cwd=worker_procs.REPO, env=worker_procs.worker_env(4), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    s = store.open_store(run)
    deadline, victim = time.monotonic() + 300, None
    while victim is None:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        for key in s.list(layout.WORKERS_PREFIX):
            beat = s.read_json(key) or {}
            if beat.get("job") == "k1" and beat.get("held") and beat.get("state") != "done":
                victim = beat
        time.sleep(0.05)
    os.kill(victim["pid"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    [line] = [x for x in out.splitlines() if "died" in x and "Beam worker process" in x]
    assert f"{victim['host']} (pid {victim['pid']}, holding " in line, line
    assert f"`actx rerun {run}` finishes the run" in line, line
    assert "Traceback" not in out

    st = io.StringIO()
    cli.main(["status", run, "--json"], out=st)
    st = json.loads(st.getvalue())
    held = [layout.partition_name(p) for p in victim["held"]]
    assert {st["partitions"][p] for p in held} <= {"stale", "committed"}, st["partitions"]
    assert "stale" in {st["partitions"][p] for p in held}

    again = io.StringIO()
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump({"target": {
        "extract": "beam", "devices_per_host": 4, "batch_size": 8,
        "beam_args": ["--runner=FnApiRunner"]}}))
    assert cli.main(["rerun", run, "--config", str(one), "--job", "k2"], out=again) == 0, \
        again.getvalue()
    _assert_same_as_reference(run, reference_run)


def test_named_extractions_through_beam_one_pipeline_each(reference_run, tmp_path):
    """`actx rerun` of a run with two named extractions on the Beam target: one pipeline
    per extraction, one after another; `base` (the reference's model) equals the worker
    target's bytes, `other` (another model, same tokenizer) equals that model extracted by
    a worker process; heartbeats and markers are each extraction's own."""
    import io

    import yaml

    from actx.deploy import cli
    from actx.schemas import extraction, extraction_store, layout, runspec

    ref_spec = runspec.read_run_spec(store.open_store(reference_run))
    other_model = hf_models.make_tiny_checkpoint(tmp_path / "other", "qwen2", seed=1)

    def with_extractions(path: str) -> str:
        run = worker_procs.copy_token_store(reference_run, path)
        s = store.open_store(run)
        root = runspec.read_run_spec(s)
        for name, model in (("base", ref_spec.model.path), ("other", str(other_model))):
            extraction.add(s, root, name, extraction.spec_for(
                root, runspec.ModelSpec(path=model, dtype=root.model.dtype), root.capture))
        return run

    run = with_extractions(str(tmp_path / "run"))
    cfg = tmp_path / "t.yaml"
    cfg.write_text(yaml.safe_dump({"target": {
        "extract": "beam", "devices_per_host": 4, "batch_size": 8,
        "beam_args": ["--runner=FnApiRunner"]}}))
    out = io.StringIO()
    assert cli.main(["rerun", run, "--config", str(cfg), "--job", "b2"], out=out) == 0, \
        out.getvalue()
    assert "rerun: base: 3 partition(s); other: 3 partition(s) on local" in out.getvalue()
    log = (tmp_path / "run" / "logs" / "b2" / "beam.log").read_text()
    assert "2 extractions" in log and "0 left uncommitted" in log, log[-2000:]

    def objects(path: str, name: str) -> dict[str, bytes]:
        prefix = layout.extraction_prefix(name)
        found = worker_procs.stored_objects(path, prefix + "activations")
        return {k[len(prefix):]: v for k, v in found.items() if not k.endswith("actx.json")}

    reference = {k: v for k, v in worker_procs.stored_objects(reference_run).items()
                 if not k.endswith("actx.json")}
    assert objects(run, "base") == reference
    alone = with_extractions(str(tmp_path / "alone"))  # `other` by the worker target
    code, text = worker_procs.run_worker(["--run", alone, "--batch-size", "8",
                                          "--extraction", "other"], devices=4)
    assert code == 0, text
    assert objects(run, "other") == objects(alone, "other") != objects(run, "base")
    for name in ("base", "other"):
        view = extraction_store.view(store.open_store(run), name)
        assert sorted(commit.committed_partitions(view)) == list(range(N_ROWS // PARTITION_ROWS))
        beats = [k for k in view.list("workers/") if k.endswith(".json")]
        assert beats and all(k.startswith("workers/beam-") for k in beats), beats
    assert not os.path.exists(os.path.join(run, "commits"))  # the default: not extracted
    assert cli.main(["verify", run], out=io.StringIO()) == 0

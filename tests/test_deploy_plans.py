"""Dry runs of the tpu-vm and dataflow targets: the exact commands and worker environment.

Nothing here can run for real (no gcloud, no Cloud), so the commands are the contract:
each expected line is written out in full.
"""

from __future__ import annotations

import io
import os
import pathlib
import shlex
import sys
import tempfile

import pytest
import yaml

from actx.deploy import cli, config
from actx.deploy.targets.dataflow import plan as dataflow
from actx.deploy.targets.tpu_vm import plan as tpu_vm

METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes"
CURL = 'curl -sf -H Metadata-Flavor:Google "${ACTX_TPU_METADATA_URL:-' + METADATA + '}'
REPO = pathlib.Path(__file__).resolve().parents[1]
SPEC = {
    "name": "r1",
    "model": {"path": "gs://b/models/qwen", "dtype": "bfloat16"},
    "tokenizer": {"path": "gs://b/models/qwen"},
    "sources": [{"kind": "fineweb", "paths": ["gs://b/fineweb/*.parquet"]}],
    "packing": {"mode": "segmented", "seq_len": 1024},
    "layout": {"rows_per_shard": 64, "partition_rows": 4096},
}
TPU = {"name": "tpu1", "zone": "us-central2-b", "project": "proj", "accelerator_type": "v4-32"}
DATAFLOW = {"project": "proj", "region": "us-central1", "temp_location": "gs://b/tmp",
            "max_num_workers": 16}


@pytest.fixture(scope="module", autouse=True)
def local_inputs(tmp_path_factory, qwen_tokenizer_dir):
    """Real inputs on local disk for SPEC: `submit` checks the model, tokenizer and sources
    before it plans (deploy/preflight.py), and gs:// ones would answer differently with and
    without the GCS emulator running."""
    from actx.pipeline import sample_data
    from tests import hf_models

    root = tmp_path_factory.mktemp("plan-inputs")
    model = hf_models.make_tiny_checkpoint(root / "model", "qwen2", num_hidden_layers=2,
                                           vocab_size=151936)
    fineweb = sample_data.make_fineweb_parquet(str(root / "fw" / "000.parquet"), 4)
    SPEC.update(model={"path": str(model), "dtype": "bfloat16"},
                tokenizer={"path": qwen_tokenizer_dir},
                sources=[{"kind": "fineweb", "paths": [fineweb]}])


def _write(tmp_path, target: dict, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"run": "gs://b/runs/r1", "spec": SPEC, "target": target}))
    return str(path)


def _dry_run(argv: list[str]) -> list[str]:
    out = io.StringIO()
    assert cli.main(argv, out=out) == 0
    return [line for line in out.getvalue().splitlines()
            if line and not line.startswith(("#", "submit:", "rerun:"))]


def _fingerprint() -> str:
    from actx.schemas import runspec

    return runspec.RunSpec.from_dict(SPEC).fingerprint


def _worker_command(job: str, hosts: int, extra: str = "", batch: int = 8) -> str:
    fp = _fingerprint()
    coordinator = (f'; export ACTX_COORDINATOR="$({CURL}/worker-network-endpoints" | cut -d, '
                   f'-f1 | cut -d: -f3):8476"' if hosts > 1 else "")
    return (f'export ACTX_NUM_PROCESSES={hosts}; export ACTX_PROCESS_ID="$({CURL}'
            f'/agent-worker-number")"{coordinator}; test -n "$ACTX_PROCESS_ID" || {{ echo '
            f"'no TPU metadata server answered (agent-worker-number)' >&2; exit 1; }}; "
            f"nohup setsid python3 -m actx.deploy.host_run --run gs://b/runs/r1 --job {job} "
            f'--log-every-s 10 --host "tpu1-w$ACTX_PROCESS_ID" -- '
            f"python3 -m actx.workers.main --run gs://b/runs/r1 --batch-size {batch} "
            f"--model-parallel 1 --no-steal --no-allow-numerics-change --prefetch-depth 4 "
            f"--steps-in-flight 2 --writer-threads 4 --max-pending-mb 2048 --heartbeat-s 2 "
            f"--stop-check-steps 16 --gcs-request-concurrency 32 --gcs-request-retries 8 "
            f"--replicas 1 --replica 0 --job {job} --expect-fingerprint {fp}{extra} "
            f'--host-name "tpu1-w$ACTX_PROCESS_ID" > "$HOME/actx-{job}.out" 2>&1 < /dev/null '
            f'& echo "worker $ACTX_PROCESS_ID of {hosts} started (pid $!)"')


WHERE = ["--zone", "us-central2-b", "--project", "proj"]


def test_tpu_vm_submit_dry_run_prints_exact_commands(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _write(tmp_path, {"kind": "tpu-vm", "batch_size": 32,
                            "tpu": {**TPU, "create": True, "queued_resource": True,
                                    "spot": True}})
    job = f"j1-{os.getpid()}"
    lines = _dry_run(["submit", cfg, "--dry-run", "--job", job])
    fp = _fingerprint()
    job_dir = os.path.join(tempfile.gettempdir(), f"actx-{job}")
    wheel = "actx_lm-0.3.0-py3-none-any.whl"
    expected = [
        # The slice first: a queued resource that fails leaves nothing prepared.
        shlex.join(["gcloud", "compute", "tpus", "queued-resources", "create", "tpu1",
                    "--node-id", "tpu1", *WHERE, "--accelerator-type", "v4-32",
                    "--runtime-version", "tpu-ubuntu2204-base", "--spot"]),
        shlex.join(["gcloud", "compute", "tpus", "queued-resources", "describe", "tpu1", *WHERE,
                    "--format=value(state.state)"]),
        shlex.join(["actx", "prepare", "--spec", f"{job_dir}/r1-{fp}.json", "--out",
                    "gs://b/runs/r1", "--max-reject-fraction=0.01", "--runner=FnApiRunner"]),
        shlex.join([sys.executable, "-m", "actx.deploy.targets.tpu_vm.package", "--out", job_dir]),
        shlex.join(["gcloud", "compute", "tpus", "tpu-vm", "scp", f"{job_dir}/{wheel}",
                    f"tpu1:{wheel}", *WHERE, "--worker=all"]),
        shlex.join(["gcloud", "compute", "tpus", "tpu-vm", "ssh", "tpu1", *WHERE, "--worker=all",
                    f"--command=python3 -m pip install -q \"actx-lm[workers] @ "
                    f"file://$HOME/{wheel}\" 'jax[tpu]'"]),
        shlex.join(["gcloud", "compute", "tpus", "tpu-vm", "ssh", "tpu1", *WHERE, "--worker=all",
                    "--command=" + _worker_command(job, hosts=4, batch=32)]),
    ]
    assert lines == expected
    # A dry run writes nothing: not the spec file it names, not the wheel's directory.
    assert not os.path.exists(job_dir) and os.listdir(tmp_path) == ["c.yaml"]


def test_tpu_worker_environment_per_slice_size():
    four = config.TpuConfig(**TPU)
    env = tpu_vm.worker_env(four)
    assert env == {
        "ACTX_NUM_PROCESSES": "4",
        "ACTX_PROCESS_ID": f'"$({CURL}/agent-worker-number")"',
        "ACTX_COORDINATOR": (f'"$({CURL}/worker-network-endpoints" | cut -d, -f1 | '
                             f'cut -d: -f3):8476"'),
    }
    one = config.TpuConfig(**{**TPU, "accelerator_type": "v5litepod-8", "env": {"A": "x y"}})
    assert tpu_vm.worker_env(one) == {
        "ACTX_NUM_PROCESSES": "1",
        "ACTX_PROCESS_ID": env["ACTX_PROCESS_ID"], "A": "'x y'"}
    assert [tpu_vm.slice_hosts(config.TpuConfig(accelerator_type=t))
            for t in ("v4-8", "v4-32", "v5p-128", "v5litepod-16", "v6e-8", "v3-32")] == \
        [1, 4, 16, 4, 1, 4]
    with pytest.raises(tpu_vm.TargetError, match="'weird-4' is not a Cloud TPU type"):
        tpu_vm.slice_hosts(config.TpuConfig(accelerator_type="weird-4"))


def test_tpu_vm_prepare_on_dataflow_existing_slice_custom_install(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _write(tmp_path, {"kind": "tpu-vm", "prepare": "dataflow", "dataflow": DATAFLOW,
                            "tpu": {**TPU, "install": "actx-lm[workers,gcs]==0.3.0"}})
    lines = _dry_run(["submit", cfg, "--dry-run", "--job", "j2", "--batch-size", "16"])
    fp = _fingerprint()
    job_dir = os.path.join(tempfile.gettempdir(), "actx-j2")
    assert lines[0] == shlex.join([sys.executable, "-m", "actx.deploy.targets.dataflow.stage", "--out",
                                   f"{job_dir}/dataflow-src"])
    assert lines[1] == shlex.join([
        "actx", "prepare", "--spec", os.path.join(job_dir, f"r1-{fp}.json"),
        "--out", "gs://b/runs/r1", "--max-reject-fraction=0.01", "--runner=DataflowRunner",
        "--project=proj", "--region=us-central1", "--temp_location=gs://b/tmp",
        "--staging_location=gs://b/tmp/staging", f"--setup_file={job_dir}/dataflow-src/setup.py",
        f"--job_name=actx-prepare-r1-{fp}", "--max_num_workers=16"])
    assert lines[2:] == [
        shlex.join(["gcloud", "compute", "tpus", "tpu-vm", "ssh", "tpu1", *WHERE, "--worker=all",
                    "--command=python3 -m pip install -q 'actx-lm[workers,gcs]==0.3.0' 'jax[tpu]'"]),
        shlex.join(["gcloud", "compute", "tpus", "tpu-vm", "ssh", "tpu1", *WHERE, "--worker=all",
                    "--command=" + _worker_command("j2", hosts=4, batch=16)]),
    ]


def test_dataflow_submit_dry_run_and_pipeline_options(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    df = {**DATAFLOW, "machine_type": "n2-highmem-8", "extra_args": ["--experiments=use_runner_v2"]}
    cfg = _write(tmp_path, {"kind": "dataflow", "dataflow": df})
    lines = _dry_run(["submit", cfg, "--dry-run", "--job", "j0"])
    fp = _fingerprint()
    job_dir = os.path.join(tempfile.gettempdir(), "actx-j0")
    setup_py = f"{job_dir}/dataflow-src/setup.py"
    argv = ["--spec", os.path.join(job_dir, f"r1-{fp}.json"),
            "--out", "gs://b/runs/r1",
            "--max-reject-fraction=0.01", "--runner=DataflowRunner", "--project=proj",
            "--region=us-central1", "--temp_location=gs://b/tmp",
            "--staging_location=gs://b/tmp/staging", f"--setup_file={setup_py}",
            f"--job_name=actx-prepare-r1-{fp}", "--max_num_workers=16",
            "--machine_type=n2-highmem-8", "--experiments=use_runner_v2"]
    assert lines == [shlex.join([sys.executable, "-m", "actx.deploy.targets.dataflow.stage", "--out",
                                 f"{job_dir}/dataflow-src"]),
                     shlex.join(["actx", "prepare", *argv])]
    assert not os.path.exists(job_dir)  # the dry run wrote nothing
    # The flags are what Beam's PipelineOptions understand.
    from apache_beam.options.pipeline_options import (GoogleCloudOptions, PipelineOptions,
                                                      SetupOptions, StandardOptions)

    opts = PipelineOptions(argv[5:])
    gcp = opts.view_as(GoogleCloudOptions)
    assert opts.view_as(StandardOptions).runner == "DataflowRunner"
    assert (gcp.project, gcp.region, gcp.temp_location, gcp.job_name) == (
        "proj", "us-central1", "gs://b/tmp", f"actx-prepare-r1-{fp}")
    assert opts.view_as(SetupOptions).setup_file == setup_py


def test_remote_targets_need_gs_and_names(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cfg = _write(tmp_path, {"kind": "tpu-vm", "tpu": {"accelerator_type": "v4-8"}})
    assert cli.main(["submit", cfg, "--dry-run"], out=io.StringIO()) == 2
    assert "target.tpu: name, zone, project required" in capsys.readouterr().err
    cfg = _write(tmp_path, {"kind": "dataflow", "dataflow": DATAFLOW})
    assert cli.main(["submit", cfg, "--dry-run", "--run", str(tmp_path / "r")],
                    out=io.StringIO()) == 2
    assert "need a gs:// run directory" in capsys.readouterr().err


def test_rerun_dry_run_on_tpu_vm_names_only_uncommitted(tmp_path):
    from tests import token_runs

    from actx.schemas import commit, store

    run = str(tmp_path / "run")
    spec = token_runs.write_token_run(run, "unused-model", n_rows=24, partition_rows=8)
    s = store.open_store(run)
    s.create_json("commits/p-00001.json", {"partition": 1})  # listing is what counts
    assert commit.committed_partitions(s) == {1}
    cfg = tmp_path / "t.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"kind": "tpu-vm", "tpu": TPU}}))
    out = io.StringIO()
    # A local run cannot be reached from TPU hosts.
    assert cli.main(["rerun", run, "--config", str(cfg), "--dry-run"], out=out) == 2
    lines = tpu_vm.plan("gs://b/runs/r1", config.TargetConfig(batch_size=16,
                                                             tpu=config.TpuConfig(**TPU)),
                        spec.fingerprint, "j3", only=[0, 2], install=False)
    assert len(lines) == 1 and "--only 0,2 --host-name" in lines[0].argv[-1]
    # After a preemption: delete (it may be gone already), request, wait, install, start.
    plan = tpu_vm.plan("gs://b/runs/r1", config.TargetConfig(
        batch_size=16, tpu=config.TpuConfig(**TPU, queued_resource=True)), spec.fingerprint,
        "j4", only=[0, 2], install=False, recreate=True, config="t.yaml")
    assert [(c.argv[3:5] if c.argv[0] == "gcloud" else c.argv[1:3], c.may_fail)
            for c in plan] == [
        (("queued-resources", "delete"), True), (("queued-resources", "create"), False),
        (("queued-resources", "describe"), False), (("-m", "actx.deploy.targets.tpu_vm.package"), False),
        (("tpu-vm", "scp"), False), (("tpu-vm", "ssh"), False), (("tpu-vm", "ssh"), False)]
    assert "--only 0,2 --host-name" in plan[-1].argv[-1]
    assert plan[-1].on_fail.endswith("--config t.yaml --recreate`")


def test_example_tpu_config_passes_the_checks_and_downs_what_it_created(tmp_path):
    example = os.path.join(REPO, "configs", "example_tpu.yaml")
    cfg = config.load_submit_config(example)
    tpu_vm.check(cfg.run, cfg.target)
    shape = tpu_vm.slice_shape(cfg.target.tpu)
    assert (shape.hosts, shape.devices_per_host, cfg.target.batch_size % shape.devices) == \
        (4, 4, 0)
    plan = tpu_vm.plan(cfg.run, cfg.target, "fp", "ex")
    assert [c.argv[4] for c in plan if c.argv[0] == "gcloud"] == \
        ["create", "describe", "scp", "ssh", "ssh"]
    down = io.StringIO()
    assert cli.main(["down", "--config", example, "--dry-run"], out=down) == 0
    assert down.getvalue().splitlines()[-1] == shlex.join([
        "gcloud", "compute", "tpus", "queued-resources", "delete", "actx-v4-32", "--zone",
        "us-central2-b", "--project", "my-project", "--force", "--quiet"])


def test_prepare_typed_for_dataflow_stages_what_the_workers_need():
    """`actx prepare --runner=DataflowRunner` typed by hand stages the same copy as submit:
    a setup.py whose install_requires hold what prepare's DoFns import."""
    import ast

    argv = ["--spec", "s.json", "--out", "gs://b/r", "--runner", "DataflowRunner"]
    staged = cli._staged_for_dataflow(argv)
    assert staged[:-1] == argv and staged[-1].startswith("--setup_file=")
    setup_py = staged[-1].split("=", 1)[1]
    tree = ast.parse(open(setup_py).read())
    [call] = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
              and getattr(n.func, "id", "") == "setup"]
    requires = ast.literal_eval(next(k.value for k in call.keywords
                                     if k.arg == "install_requires"))
    assert any(r.startswith("tokenizers") for r in requires)
    assert any(r.startswith("numpy") for r in requires)
    # Given a setup file, or another runner: unchanged.
    for argv in (["--runner=DataflowRunner", "--setup_file=mine/setup.py"],
                 ["--runner=FnApiRunner"], []):
        assert cli._staged_for_dataflow(argv) == argv

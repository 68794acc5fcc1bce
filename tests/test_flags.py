"""Worker options are defined once (schemas/worker_options.py): the worker's flags, the
submit config's target table and the argv the launchers build all derive from it."""

from __future__ import annotations

import dataclasses
import os

import pytest
import yaml

from actx.deploy import config as deploy_config
from actx.deploy import local
from actx.deploy.targets.tpu_vm import plan as tpu_vm
from actx.schemas import flags
from actx.schemas.worker_options import ExtractSettings, WorkerOptions
from actx.workers import main as worker_main


def _parse(argv: list[str]) -> WorkerOptions:
    return flags.from_namespace(WorkerOptions, worker_main.build_parser().parse_args(argv))


def _non_default(cls):
    """A value of every field unlike its default, by type."""
    values = {}
    for f in dataclasses.fields(cls):
        default = f.default
        if f.name == "run":
            values[f.name] = "gs://b/runs/r"
        elif f.name == "only":
            values[f.name] = (3, 7, 9)
        elif isinstance(default, bool):
            values[f.name] = not default
        elif isinstance(default, int):
            values[f.name] = default + 3
        elif isinstance(default, float):
            values[f.name] = default + 0.25
        elif f.name in ("num_processes", "process_id"):
            values[f.name] = 5
        else:
            values[f.name] = f"x-{f.name}"
    return values


def test_argv_round_trips_every_field():
    opts = WorkerOptions(**_non_default(WorkerOptions))
    assert _parse(opts.to_argv()) == opts
    assert _parse(WorkerOptions(run="r").to_argv()) == WorkerOptions(run="r")


def test_every_field_has_help_and_a_flag():
    parser = worker_main.build_parser()
    by_dest = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(WorkerOptions):
        assert f.name in by_dest, f.name
        assert by_dest[f.name].help and len(by_dest[f.name].help) > 10, f.name


def test_target_table_carries_every_extract_setting(tmp_path):
    """A setting written in the config's target table reaches the worker unchanged, on
    both launchers."""
    settings = {k: v for k, v in _non_default(ExtractSettings).items()}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "run": "gs://b/runs/r",
        "spec": {"name": "r", "model": {"path": "m"}, "tokenizer": {"path": "t"},
                 "sources": [{"kind": "text", "paths": ["x.jsonl"]}],
                 "packing": {"seq_len": 16}, "capture": {"hooks": "layers.0.resid_post"}},
        "target": {**settings, "hosts": 2, "kind": "local",
                   "tpu": {"name": "t", "zone": "z", "project": "p"}}}))
    target = deploy_config.load_submit_config(str(cfg)).target
    for name, value in settings.items():
        assert getattr(target, name) == value

    opts = _parse(local.worker_args("gs://b/runs/r", target, "fp", "j", 1, 0, None, [2]))
    assert opts == WorkerOptions.for_job(target, run="gs://b/runs/r", replicas=2, replica=1,
                                         job="j", expect_fingerprint="fp",
                                         host_name="local-r1h0", only=(2,),
                                         steal=settings["steal"])
    argv = tpu_vm.worker_argv("gs://b/runs/r", target, "fp", "j")
    assert argv[:3] == ["python3", "-m", "actx.workers.main"]
    opts = _parse(argv[3:])
    for name, value in settings.items():
        if name != "steal":  # the slice is one replica: nothing to steal from
            assert getattr(opts, name) == value, name
    assert opts.steal is False and opts.replicas == 1


def test_cli_target_flags_match_the_config_fields():
    from actx.deploy import cli

    parser = cli.build_parser()
    submit = parser._subparsers._group_actions[0].choices["submit"]
    dests = {a.dest: a for a in submit._actions}
    fields = {f.name: f for f in dataclasses.fields(deploy_config.TargetConfig)}
    from actx.deploy import jobs

    for name in jobs.TARGET_FLAGS:
        assert dests[name].default is None and name in fields
    args = parser.parse_args(["submit", "--batch-size", "16", "--model-parallel", "2"])
    base = deploy_config.TargetConfig()
    target = jobs._target(base, args)
    assert (target.batch_size, target.model_parallel, target.hosts) == (16, 2, base.hosts)


def test_field_docs_reads_continuations_and_shared_lines():
    @dataclasses.dataclass
    class Example:
        """Intro line.

        a / b: shared text
          continued here.
        c: own text.
        Closing prose that belongs to no field.
        """

        a: int = 0
        b: int = 0
        c: int = 0

    docs = flags.field_docs(Example)
    assert docs == {"a": "shared text continued here.", "b": "shared text continued here.",
                    "c": "own text."}


def test_bad_flag_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        worker_main.build_parser().parse_args(["--run", "r", "--only", "3,x"])
    assert e.value.code == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_local_workers_keep_the_users_xla_flags(tmp_path, monkeypatch):
    """A local worker simulates its host's chips as XLA CPU devices and keeps every other
    XLA flag the user set: here XLA's own dump directory fills, and the device count is
    the target's, not the user's."""
    import subprocess
    import sys

    dump = tmp_path / "dump"
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to={dump} "
                                    f"--xla_force_host_platform_device_count=7")
    target = dataclasses.replace(deploy_config.TargetConfig(), devices_per_host=3)
    env = local.worker_env(target)
    out = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.device_count()); "
                               "jax.jit(lambda x: x * 2)(1.0).block_until_ready()"],
        env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["3"]
    assert any(name.endswith(".txt") for name in os.listdir(dump)), os.listdir(dump)

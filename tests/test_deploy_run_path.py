"""Paths and flags of submit and rerun: a config's `run:` is taken from the config file's
directory like its other paths (the embedded demo's from the current directory), a run
made the old way (from the current directory) is never quietly prepared again elsewhere,
and `actx rerun RUN` launches as the run's last launch did (hosts, batch size) unless
told otherwise."""

from __future__ import annotations

import argparse
import io
import json
import os

import pytest
import yaml

from actx.deploy import cli, jobs, launch_record
from actx.deploy import config as deploy_config
from actx.schemas import config as config_lib, store
from tests import hf_models, token_runs

SPEC = {"name": "paths", "model": {"path": "model"}, "tokenizer": {"path": "tok"},
        "sources": [{"kind": "text", "paths": ["data.jsonl"]}]}


def _config(directory, run: str = "runs/x") -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "c.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"run": run, "spec": SPEC}, f)
    return path


def test_run_is_taken_from_the_config_files_directory(tmp_path, monkeypatch):
    config = _config(tmp_path / "project")
    monkeypatch.chdir(tmp_path)  # elsewhere
    cfg = deploy_config.load_submit_config(config)
    assert cfg.run == str(tmp_path / "project" / "runs" / "x")
    assert cfg.spec.model.path == str(tmp_path / "project" / "model")  # as before
    for absolute in ("gs://b/runs/x", "memory://r", str(tmp_path / "abs")):
        assert deploy_config.load_submit_config(_config(tmp_path / "p2", absolute)).run \
            == absolute
    # --set run=... is a config value: from the config's directory too.
    cfg = deploy_config.load_submit_config(config, ["run=other"])
    assert cfg.run == str(tmp_path / "project" / "other")
    # The embedded demo keeps runs/demo where its walk-through looks: the current directory.
    assert deploy_config.load_submit_config(None).run == "runs/demo"


def _old_run(where: str, fingerprint: str) -> None:
    os.makedirs(where)
    with open(os.path.join(where, "run.json"), "w") as f:
        json.dump({"fingerprint": fingerprint}, f)


def test_a_run_made_the_old_way_is_refused_naming_both_paths(tmp_path, monkeypatch, capsys):
    config = _config(tmp_path / "project")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # where the run was submitted from before
    fingerprint = deploy_config.load_submit_config(config).spec.fingerprint
    old = str(tmp_path / "elsewhere" / "runs" / "x")
    new = str(tmp_path / "project" / "runs" / "x")
    _old_run(old, fingerprint)
    before = sorted(os.listdir(tmp_path / "project"))
    assert cli.main(["submit", config], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert f"{config}: run: 'runs/x' is taken from the config file's directory" in err
    assert new in err and old in err and fingerprint in err and "Nothing was done" in err
    assert f"--run {old}" in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path / "project")) == before  # nothing written
    # What it offers works: --run names the old run (a command-line path: no check) ...
    cfg = deploy_config.load_submit_config(config, check_old_run=False)
    assert cfg.run == new
    # ... and once the config's place exists, that is the run.
    os.makedirs(new)
    assert deploy_config.load_submit_config(config).run == new
    os.rmdir(new)
    # Another spec's run at the old place is another run: no refusal.
    with open(os.path.join(old, "run.json"), "w") as f:
        json.dump({"fingerprint": "0" * 16}, f)
    assert deploy_config.load_submit_config(config).run == new


def _rerun_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["rerun", "RUN", *argv])


def test_rerun_launches_as_the_last_launch_unless_told_otherwise(tmp_path):
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=1)
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, str(model), n_rows=32, seq_len=16, partition_rows=8,
                               rows_per_shard=4)
    s = store.open_store(run)
    assert launch_record.read(s) is None
    out = io.StringIO()
    assert cli.main(["rerun", run, "--hosts", "2", "--batch-size", "4", "--job", "first",
                     "--only", "0,1"], out=out) == 0, out.getvalue()
    recorded = launch_record.read(s)
    assert recorded["job"] == "first" and recorded["target"] == "local"
    assert (recorded["hosts"], recorded["batch_size"]) == (2, 4)

    said = io.StringIO()
    target = jobs._rerun_target(_rerun_args(), s, said)
    assert (target.hosts, target.batch_size) == (2, 4)
    assert "rerun: as the run's last launch: hosts 2, batch_size 4" in said.getvalue()
    # A flag wins over the record; the record fills in the rest.
    target = jobs._rerun_target(_rerun_args("--batch-size", "8"), s, io.StringIO())
    assert (target.hosts, target.batch_size) == (2, 8)
    # A config's target table is what the user gave: the record does not apply.
    cfg = tmp_path / "t.yaml"
    cfg.write_text("target:\n  hosts: 1\n")
    target = jobs._rerun_target(_rerun_args("--config", str(cfg)), s, io.StringIO())
    assert (target.hosts, target.batch_size) == (1, deploy_config.TargetConfig().batch_size)
    # Another target's record does not apply either.
    s.write_json(launch_record.KEY, {**recorded, "target": "tpu-vm"})
    target = jobs._rerun_target(_rerun_args(), s, io.StringIO())
    assert target.hosts == deploy_config.TargetConfig().hosts
    s.write_json(launch_record.KEY, recorded)

    # The plain rerun, with no flag, runs on the recorded 2 hosts and finishes the run.
    out = io.StringIO()
    assert cli.main(["rerun", run, "--job", "second"], out=out) == 0, out.getvalue()
    beats = {k: s.read_json(k) for k in s.list("workers/")}
    assert {b["host"] for b in beats.values() if b["job"] == "second"} == {
        "local-r0h0", "local-r1h0"}
    assert len(s.list("commits/")) == 4

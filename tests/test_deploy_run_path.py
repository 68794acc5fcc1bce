"""Paths and flags of submit and rerun: a config's `run:` is taken from the config file's
directory like its other paths (the embedded demo's from the current directory), a run
made the old way (from the current directory) is never quietly prepared again elsewhere,
and `actx rerun RUN` launches as the run's last launch did (hosts, batch size) unless
told otherwise."""

from __future__ import annotations

import argparse
import dataclasses
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
    assert (recorded["hosts"], recorded["batch_size"], recorded["models_at_once"]) == (2, 4, 1)

    said = io.StringIO()
    target = jobs._rerun_target(_rerun_args(), s, said)
    assert (target.hosts, target.batch_size) == (2, 4)
    assert "rerun: as the run's last launch: hosts 2, batch_size 4" in said.getvalue()
    # Several models at once (named extractions) is replayed too, flag or config alike;
    # a record from before it was kept reruns one model at a time.
    s.write_json(launch_record.KEY, {**recorded, "models_at_once": 2})
    said = io.StringIO()
    assert jobs._rerun_target(_rerun_args(), s, said).models_at_once == 2
    assert "hosts 2, batch_size 4, models_at_once 2 (flags" in said.getvalue()
    assert jobs._rerun_target(_rerun_args("--models-at-once", "3"), s,
                              io.StringIO()).models_at_once == 3
    s.write_json(launch_record.KEY, {k: v for k, v in recorded.items()
                                     if k != "models_at_once"})
    assert jobs._rerun_target(_rerun_args(), s, io.StringIO()).models_at_once == 1
    s.write_json(launch_record.KEY, recorded)
    # A flag wins over the record; the record fills in the rest.
    target = jobs._rerun_target(_rerun_args("--batch-size", "8"), s, io.StringIO())
    assert (target.hosts, target.batch_size) == (2, 8)
    # A config's target table is what the user gave: the record does not apply.
    cfg = tmp_path / "t.yaml"
    cfg.write_text("target:\n  hosts: 1\n")
    target = jobs._rerun_target(_rerun_args("--config", str(cfg)), s, io.StringIO())
    assert (target.hosts, target.batch_size) == (1, deploy_config.TargetConfig().batch_size)
    # Another target's record does not apply to a rerun on local.
    s.write_json(launch_record.KEY, {**recorded, "target": "tpu-vm"})
    target = jobs._rerun_target(_rerun_args("--target", "local"), s, io.StringIO())
    assert (target.kind, target.hosts) == ("local", deploy_config.TargetConfig().hosts)
    s.write_json(launch_record.KEY, recorded)

    # A rerun the run refuses (another batch size: other rows per device than its
    # numerics record) extracts nothing, shows as a refused attempt, not a failed host,
    # and leaves the record as it was: the plain rerun still launches the run's way.
    for extra in ([], ["--join"]):
        out = io.StringIO()
        assert cli.main(["rerun", run, "--hosts", "1", "--batch-size", "8", "--only", "2",
                         "--job", f"bad{len(extra)}", *extra], out=out) == 1, out.getvalue()
        assert launch_record.read(s) == recorded
    assert len(s.list("commits/")) == 2
    st = _status_json(run)
    refused = {h["host"]: h for h in st["hosts"] if h["state"] == "refused"}
    assert sorted(refused) == ["local-bad1-r0h0", "local-r0h0"], st["hosts"]
    assert all("refused: " in h["message"] and "rows_per_device" in h["message"]
               for h in refused.values()), refused
    assert not [h for h in st["hosts"] if h["state"].startswith("failed")], st["hosts"]

    # The plain rerun, with no flag, runs on the recorded 2 hosts and finishes the run;
    # the refused attempts are gone from status.
    out = io.StringIO()
    assert cli.main(["rerun", run, "--job", "second"], out=out) == 0, out.getvalue()
    beats = {k: s.read_json(k) for k in s.list("workers/")}
    assert {b["host"] for b in beats.values() if b["job"] == "second"} == {
        "local-r0h0", "local-r1h0"}
    assert len(s.list("commits/")) == 4
    st = _status_json(run)
    assert st["phase"] == "finished"
    assert sorted(h["host"] for h in st["hosts"]) == ["local-r0h0", "local-r1h0"]


def _status_json(run: str) -> dict:
    out = io.StringIO()
    assert cli.main(["status", run, "--json"], out=out) == 0, out.getvalue()
    return json.loads(out.getvalue())


def test_rerun_stays_on_the_runs_own_slurm_target(tmp_path):
    """A run last launched on slurm reruns there, from the config file its launch recorded
    (its target table, with the --set overrides given then): `actx rerun RUN` as status
    advises it. --target or --config override; a config that is gone is a clear error."""
    run = str(tmp_path / "run")
    os.makedirs(run)
    s = store.open_store(run)
    cfg = tmp_path / "slurm.yaml"
    cfg.write_text(yaml.safe_dump({"run": run, "target": {
        "kind": "slurm", "batch_size": 8, "slurm": {"name": "lab", "nodes": 2,
                                                    "partition": "gpu"}}}))
    target = deploy_config.TargetConfig(kind="slurm", batch_size=16)
    launch_record.record(s, target, "first", str(cfg), ["target.slurm.nodes=4"])
    assert launch_record.read(s)["config"] == str(cfg)

    args, said = _rerun_args(), io.StringIO()
    args.run = run
    target = jobs._rerun_target(args, s, said)
    # The config's table and its recorded override; the launch's batch size over both.
    assert (target.kind, target.slurm.name, target.slurm.nodes, target.slurm.partition,
            target.batch_size) == ("slurm", "lab", 4, "gpu", 16)
    assert (args.config, args.set) == (str(cfg), ["target.slurm.nodes=4"])
    assert (f"rerun: as the run's last launch: on slurm with {cfg} --set "
            f"target.slurm.nodes=4, batch_size 16") in said.getvalue()
    # --target local: the local defaults; --config: that file's table alone.
    target = jobs._rerun_target(_rerun_args("--target", "local"), s, io.StringIO())
    assert (target.kind, target.batch_size) == ("local", deploy_config.TargetConfig().batch_size)
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"target": {"kind": "slurm", "slurm": {"name": "x"}}}))
    target = jobs._rerun_target(_rerun_args("--config", str(other)), s, io.StringIO())
    assert (target.slurm.name, target.slurm.nodes) == ("x", 1)
    # The recorded config gone: one line saying what to give.
    os.remove(cfg)
    args = _rerun_args()
    args.run = run
    with pytest.raises(Exception) as e:
        jobs._rerun_target(args, s, io.StringIO())
    assert str(e.value) == (f"rerun on slurm: the run's last launch used the config {cfg}, "
                            f"which is gone; give one with its target table: `actx rerun "
                            f"{run} --target slurm --config CONFIG`")
    # A record from before configs were recorded: the same, with --config named.
    s.write_json(launch_record.KEY, {"job": "old", "target": "slurm", "batch_size": 16})
    with pytest.raises(Exception, match="recorded no slurm config"):
        jobs._rerun_target(args, s, io.StringIO())


def test_a_detached_job_the_run_refuses_later_leaves_the_earlier_launch_to_rerun(tmp_path):
    """A Slurm (or tpu-vm) job's workers start after `actx submit` ended, and may then be
    refused (another batch size); the plain rerun still launches as the job before it did,
    whenever the refusal came; a job that was not refused is the one a rerun follows.
    Named extractions' workers say so in their own heartbeats."""
    import time

    from actx.schemas import extraction_store, heartbeat, layout

    run = str(tmp_path / "run")
    os.makedirs(run)
    s = store.open_store(run)
    cfg = tmp_path / "slurm.yaml"
    cfg.write_text(yaml.safe_dump({"run": run, "target": {
        "kind": "slurm", "slurm": {"name": "lab", "nodes": 2}}}))
    first = deploy_config.TargetConfig(kind="slurm", batch_size=16)
    launch_record.record(s, first, "first", str(cfg))
    recorded = launch_record.read(s)
    assert (recorded["job"], recorded["batch_size"]) == ("first", 16)

    def worker_says(job: str, state: str, extraction: str = "") -> None:
        beat = heartbeat.Heartbeat(host="lab-r0h0", replica=0, process_index=0, state=state,
                                   attempt="a", updated_at=time.time(), job=job)
        extraction_store.view(s, extraction).write_json(
            layout.heartbeat_key("lab-r0h0"), config_lib.to_dict(beat))

    for extractions, where in ((None, ""), (["", "second"], "second")):
        launch_record.record(s, dataclasses.replace(first, batch_size=8), "bad", str(cfg),
                             extractions=extractions)
        assert launch_record.read(s)["job"] == "bad"  # its workers have not said yet
        worker_says("bad", "refused", where)  # ... after `actx submit` ended
        assert launch_record.read(s) == recorded
        args = _rerun_args()
        args.run = run
        assert jobs._rerun_target(args, s, io.StringIO()).batch_size == 16
        worker_says("first", "working", where)
        launch_record.record(s, first, "first", str(cfg))  # put back as it was
        recorded = launch_record.read(s)
    # A job its workers accept is what the next rerun follows.
    launch_record.record(s, dataclasses.replace(first, batch_size=32), "good", str(cfg))
    worker_says("good", "working")
    assert launch_record.read(s)["batch_size"] == 32
    # No job before the refused one: no record, the defaults apply.
    s.delete(launch_record.KEY)
    launch_record.record(s, first, "lone", str(cfg))
    worker_says("lone", "refused")
    assert launch_record.read(s) is None

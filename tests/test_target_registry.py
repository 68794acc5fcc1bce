"""One list of targets (deploy.targets.KINDS): the command line's --target choices, the
config's allowed target.kind and the dispatch all read it, so a new target is registered
there and nowhere else."""

from __future__ import annotations

import dataclasses
import importlib
import typing

from actx.deploy import cli, config, targets


def _target_choices() -> list[str]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.choices and "submit" in a.choices)
    return list(next(a for a in sub.choices["submit"]._actions if a.dest == "target").choices)


def test_cli_config_and_dispatch_read_the_registry():
    assert _target_choices() == list(targets.NAMES)
    kind = typing.get_type_hints(config.TargetConfig)["kind"]
    assert typing.get_args(kind) == targets.NAMES
    tables = {f.name: f.type for f in dataclasses.fields(config.TargetConfig)}
    for name, kind in targets.KINDS.items():
        cls = getattr(importlib.import_module(kind.module), kind.cls)
        assert issubclass(cls, targets.Target) and cls.kind == name
        assert kind.table is None or kind.table in tables, (name, kind.table)
        target = targets.for_config(config.TargetConfig(kind=name))
        assert type(target) is cls


def test_a_registered_kind_is_offered_and_dispatched(monkeypatch):
    """Registering a target is what it takes: the parser offers it and for_config builds
    its class (a throwaway one of this module). The config's Literal is the registry's
    names as imported (test above), so it needs no edit either."""
    monkeypatch.setattr(targets, "KINDS", {**targets.KINDS,
                                           "toy": targets.Kind("toy", __name__, "ToyTarget")})
    monkeypatch.setattr(targets, "NAMES", (*targets.NAMES, "toy"))
    assert _target_choices()[-1] == "toy"
    cfg = dataclasses.replace(config.TargetConfig(), kind="toy")
    assert isinstance(targets.for_config(cfg), ToyTarget)


def test_an_unregistered_kind_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: r\nspec: {model: {path: m}, tokenizer: {path: m}, sources: "
                    "[{kind: text, name: d, paths: [d.jsonl]}]}\ntarget: {kind: nope}\n")
    try:
        config.load_submit_config(str(path), check_old_run=False)
    except config.config_lib.ConfigError as e:
        assert "target.kind" in str(e) and all(n in str(e) for n in targets.NAMES), str(e)
    else:
        raise AssertionError("target.kind: nope was accepted")


class ToyTarget(targets.Target):
    kind = "toy"


def test_targets_whose_hosts_run_the_workers_refuse_beam_extraction_by_name(tmp_path):
    """tpu-vm and slurm start the workers on their own hosts: `extract: beam` is refused at
    the pre-flight, naming the key and the kinds that run Beam; `extract: workers` is not."""
    run = str(tmp_path / "run")
    for kind, who in (("tpu-vm", "a TPU slice"), ("slurm", "a Slurm job")):
        beam = targets.for_config(config.TargetConfig(kind=kind, extract="beam"))
        found, _ = beam.problems(run)
        line = [p for p in found if p.startswith("target.extract:")]
        assert line == [f'target.extract: "beam" runs on Beam runners (kind "local" or '
                        f'"dataflow"); {who} runs the workers themselves'], (kind, found)
        workers = targets.for_config(config.TargetConfig(kind=kind, extract="workers"))
        assert not [p for p in workers.problems(run)[0] if p.startswith("target.extract:")]

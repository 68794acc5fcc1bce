"""Refusals a newcomer meets, each saying the way forward (from a walkthrough as a new
user, 2026-12-08): hooks written as a YAML list, and capture settings changed on a run
with committed partitions."""

from __future__ import annotations

import dataclasses

import pytest

from actx.schemas import config, run_dir, runspec, store
from tests import reader_fixtures


def test_hooks_as_a_yaml_list_say_how_they_are_written():
    with pytest.raises(config.ConfigError) as raised:
        config.from_dict(runspec.CaptureConfig, {"hooks": ["layers.0.resid_post",
                                                         "layers.1.mlp_out"]}, "spec.capture")
    assert str(raised.value).endswith(
        "; write them comma-separated in one string: 'layers.0.resid_post,layers.1.mlp_out'")
    # Another string field given a list: no such hint (its values are not comma lists).
    with pytest.raises(config.ConfigError) as raised:
        config.from_dict(runspec.ModelSpec, {"path": ["a", "b"]}, "spec.model")
    assert "comma-separated" not in str(raised.value)


def test_new_capture_settings_on_a_committed_run_name_a_named_extraction(tmp_path):
    uri = str(tmp_path / "run")
    reader_fixtures.build_run(uri, num_partitions=2, committed=(0,))
    s = store.open_store(uri)
    spec = runspec.read_run_spec(s)
    changed = dataclasses.replace(spec, capture=dataclasses.replace(
        spec.capture, dtype="bfloat16" if spec.capture.dtype != "bfloat16" else "float32"))
    with pytest.raises(run_dir.CommittedRunError) as raised:
        run_dir.switch_extraction_spec(s, changed)
    message = str(raised.value)
    assert "activations of two settings would mix" in message
    assert "named extraction (`extractions:` in the config, docs/several-models.md)" in message


def test_every_problem_of_a_config_is_said_at_once(tmp_path):
    """Two mistakes, in two tables: both named, each on its line (a config was refused
    for its first mistake, then again for the next); one mistake reads as it did."""
    with pytest.raises(config.ConfigError) as raised:
        config.from_dict(runspec.RunSpec, {
            "name": "x", "model": {"path": "m"}, "tokenizer": {"path": "m"},
            "sources": [{"kind": "text", "paths": ["a.jsonl"]}],
            "packing": {"mode": "segmneted", "seq_len": 16},
            "capture": {"hook": "layers.0.resid_post"}}, "run.yaml: ")
    lines = str(raised.value).splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("run.yaml: packing.mode: expected one of "), lines
    assert lines[1].startswith("run.yaml: capture.hook: unknown key (did you mean 'hooks'?)")
    with pytest.raises(config.ConfigError) as raised:
        config.from_dict(runspec.CaptureConfig, {"hook": "x"}, "spec.capture")
    assert str(raised.value) == ("spec.capture.hook: unknown key (did you mean 'hooks'?); "
                                 "known keys here: dtype, hooks")

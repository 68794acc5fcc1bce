"""A run directory that holds another run is refused, and the refusal names the settings
that differ (the config line that moved it to another run), not only two fingerprints."""

from __future__ import annotations

import pytest

from actx.pipeline import prepare_refusals
from actx.schemas import runspec
from actx.schemas import store


def _spec(seq_len: int = 32, hooks: str = "layers.0.resid_post") -> runspec.RunSpec:
    return runspec.RunSpec.from_dict({
        "name": "mine", "model": {"path": "models/m"}, "tokenizer": {"path": "models/m"},
        "sources": [{"kind": "text", "paths": ["data/notes.jsonl"]}],
        "packing": {"mode": "segmented", "seq_len": seq_len},
        "capture": {"hooks": hooks},
        "layout": {"rows_per_shard": 2, "partition_rows": 4}})


def test_another_runs_directory_is_refused_naming_what_differs(tmp_path):
    run = store.open_store(str(tmp_path / "run"))
    run.write_json(runspec.RUN_SPEC_KEY, _spec().to_json_obj())
    with pytest.raises(prepare_refusals.PrepareError) as refused:
        prepare_refusals.check_run_dir(run, _spec(seq_len=64))
    message = str(refused.value)
    assert "packing.seq_len (32 there, 64 here)" in message, message
    assert "choose a new run directory" in message
    with pytest.raises(prepare_refusals.PrepareError) as refused:
        prepare_refusals.check_run_dir(run, _spec(seq_len=64, hooks="layers.1.mlp_out"))
    assert "capture.hooks" in str(refused.value) and "packing.seq_len" in str(refused.value)
    prepare_refusals.check_run_dir(run, _spec())  # the same run: no refusal


def test_prepare_takes_a_runs_own_run_json_on_gcs(gcs_bucket):
    """`actx prepare --out RUN --spec RUN/run.json`, what a damaged token store is advised
    with, reads run.json where the run is, gs:// included, as the spec it holds."""
    import argparse

    from actx.pipeline import main as prepare_main

    spec = _spec()
    run = store.open_store(f"{gcs_bucket}/runs/mine")
    run.write_json(runspec.RUN_SPEC_KEY, spec.to_json_obj())
    read = prepare_main.spec_from_args(argparse.Namespace(
        spec=f"{gcs_bucket}/runs/mine/{runspec.RUN_SPEC_KEY}"))
    assert read.fingerprint == spec.fingerprint
    with pytest.raises(Exception, match="spec file not found"):
        prepare_main.spec_from_args(argparse.Namespace(spec=f"{gcs_bucket}/runs/none/run.json"))

"""Dataflow workers get what prepare imports: the staging copy that `actx submit` passes as
--setup_file (deploy/targets/dataflow/stage.py) is built into an sdist exactly as Beam's staging
builds it, installed into a fresh virtual environment holding only apache-beam[gcp] (the
SDK container) plus what the sdist declares, and prepare run from there on a local runner
writes byte-identical output to prepare run here.

A fresh environment with apache-beam[gcp] takes minutes, so this runs only with
ACTX_INSTALL_TESTS=1, as the install tests do:
ACTX_INSTALL_TESTS=1 python3 -m pytest tests/test_dataflow_staging.py
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys

import pytest

from tests import install_venvs

pytestmark = pytest.mark.skipif(
    os.environ.get("ACTX_INSTALL_TESTS") != "1",
    reason="builds a virtual environment with apache-beam[gcp] (minutes); "
           "ACTX_INSTALL_TESTS=1 runs it")

REPO = install_venvs.REPO


def _run(cmd, **kwargs):
    return install_venvs.run_ok(cmd, timeout=900, **kwargs)


def _files(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_prepare_runs_from_what_dataflow_workers_install(tmp_path, qwen_tokenizer_dir,
                                                         fineweb_parquet):
    import apache_beam
    from apache_beam.runners.portability.stager import Stager

    from actx.schemas import runspec

    staged = _run([sys.executable, "-m", "actx.deploy.targets.dataflow.stage", "--out", tmp_path / "stage"],
                  cwd=tmp_path).stdout.strip()
    assert staged == str(tmp_path / "stage" / "setup.py")
    sdist = Stager._build_setup_package(staged, str(tmp_path / "sdist"))  # as --setup_file

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    py = venv / "bin" / "python"
    _run([py, "-m", "pip", "install", "-q", f"apache-beam[gcp]=={apache_beam.__version__}"])
    _run([py, "-m", "pip", "install", "-q", sdist])  # the SDK container's boot does this
    installed = {re.split(r"[ =@<>;]", line, maxsplit=1)[0].lower() for line in
                 _run([py, "-m", "pip", "freeze"]).stdout.splitlines()}
    assert "actx-lm" in installed and not installed & {"jax", "torch", "transformers"}

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"Document {i}: " + "words " * (i % 17)}) + "\n"
                            for i in range(60)))
    spec = runspec.RunSpec.from_dict({
        "name": "staged",
        "model": {"path": "unused"},
        "tokenizer": {"path": qwen_tokenizer_dir},
        "sources": [{"kind": "text", "name": "docs", "paths": [str(docs)]},
                    {"kind": "fineweb", "name": "fw", "paths": [fineweb_parquet]}],
        "packing": {"mode": "segmented", "seq_len": 64},
        "layout": {"rows_per_shard": 4, "partition_rows": 8},
    })
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec.to_json_obj()))
    outs = {}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for name, python, extra_env in (("staged", py, {}), ("here", sys.executable,
                                                        {"PYTHONPATH": str(REPO)})):
        out = tmp_path / f"run-{name}"
        _run([python, "-m", "actx.pipeline.main", "--spec", spec_path, "--out", out,
              "--runner=FnApiRunner"], cwd=tmp_path, env={**env, **extra_env})
        outs[name] = _files(out)
    assert outs["staged"].keys() == outs["here"].keys() and "manifest.json" in outs["here"]
    assert [k for k in outs["here"] if outs["here"][k] != outs["staged"][k]] == []

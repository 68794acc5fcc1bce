"""`actx verify --reference` of a run made from a user's Flax NNX model (`model.flax`):
each sampled document goes alone through the module called eagerly (no jit, no mesh),
and every stored hook (submodule inputs and outputs) is compared; values changed with
their checksums are caught."""

from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
import sys

import pytest
import yaml

from actx.deploy import cli
from actx.schemas import reference_verification, store
from tests.test_verify_reference import _alter

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = ["The cat sat on the mat. " * (1 + i % 5) + f"Document {i}." for i in range(12)]
HOOKS = "blocks.*:output,blocks.1.mlp:output,blocks.0.attn:input"


def _cli(*argv) -> tuple[int, str]:
    out = io.StringIO()
    return cli.main([str(a) for a in argv], out=out), out.getvalue()


@pytest.fixture(scope="module")
def flax_run(tmp_path_factory, qwen_tokenizer_dir) -> str:
    root = tmp_path_factory.mktemp("flax")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n"
                            for i, t in enumerate(DOCS)))
    config = root / "flax.yaml"
    config.write_text(yaml.safe_dump({
        "run": str(root / "run"),
        "spec": {"name": "flax", "model": {"flax": "tests.flax_models:make_masked_decoder"},
                 "tokenizer": {"path": qwen_tokenizer_dir},
                 "sources": [{"kind": "text", "paths": [str(data)]}],
                 "packing": {"mode": "segmented", "seq_len": 32, "overflow": "truncate"},
                 "capture": {"hooks": HOOKS, "dtype": "float32"},
                 "layout": {"rows_per_shard": 2, "partition_rows": 4}},
        "target": {"kind": "local", "hosts": 1, "batch_size": 2}}))
    # The factory's module must be importable where the workers start, as README asks.
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), old) if p)
    try:
        code, out = _cli("submit", config)
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    assert code == 0, out
    return str(root / "run")


def test_a_flax_run_is_recomputed_eagerly(flax_run):
    # Eager JAX compiles each operation for each document length: two documents.
    code, out = _cli("verify", flax_run, "--reference", "--sample", "2")
    assert code == 0, out
    record = reference_verification.read_record(store.open_store(flax_run))
    assert record.ok and "tests.flax_models:make_masked_decoder run eagerly" in record.reference
    assert sorted(record.hooks) == ["blocks.0.attn:input", "blocks.0:output",
                                    "blocks.1.mlp:output", "blocks.1:output", "blocks.2:output"]
    assert len(record.documents) == 2 and max(record.hooks.values()) < 1e-4


def test_altered_values_of_a_flax_run_are_caught(flax_run, tmp_path):
    run = shutil.copytree(flax_run, tmp_path / "run")
    _alter(str(run), "blocks.1.mlp:output", factor=1.01)
    assert _cli("verify", run)[0] == 0
    code, out = _cli("verify", run, "--reference", "--sample", "1")
    assert code == 1 and "hook blocks.1.mlp:output: relative error 0.01 > tolerance" in out

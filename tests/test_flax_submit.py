"""`actx submit` with `model.flax` on 2 local hosts: prepare, extract, commit, verify, and
every stored hook equal, bit for bit in fp32, to the model's own sown intermediate of the
same row (one row per device, as the workers ran it). The masked decoder runs segmented
rows on a 2-host jax.distributed replica; the plain decoder (no segment support) runs
`pad` rows on 2 one-host replicas, and is refused `segmented` before anything runs; the
Beam transform writes the same bytes for it, and the reader reads its hooks."""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import yaml
from flax import nnx

from actx.deploy import cli
from actx.schemas import commit, store
from tests import flax_models, token_runs, worker_procs

DOCS = ["The cat sat on the mat. " * (1 + i % 5) + f"Document {i}." for i in range(20)]
REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def factory_on_the_path(monkeypatch):
    """The factories are in tests/flax_models.py: on every host's PYTHONPATH, as README asks
    of a `model.flax` module (the workers start outside any checkout)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))


def _config(tmp_path, tokenizer: str, factory: str, packing: dict, hooks: str,
            target: dict) -> str:
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n"
                            for i, t in enumerate(DOCS)))
    cfg = tmp_path / "flax.yaml"
    cfg.write_text(yaml.safe_dump({
        "run": str(tmp_path / "run"),
        "spec": {"name": "flax", "model": {"flax": factory},
                 "tokenizer": {"path": tokenizer},
                 "sources": [{"kind": "text", "name": "docs", "paths": [str(data)]}],
                 "packing": {"seq_len": 32, "overflow": "truncate", **packing},
                 "capture": {"hooks": hooks, "dtype": "float32"},
                 "layout": {"rows_per_shard": 4, "partition_rows": 8, "codec": "none"}},
        "target": {"kind": "local", "devices_per_host": 2, "model_parallel": 1, **target}}))
    return str(cfg)


def _assert_hooks_equal_sown(run: str, model, names: list[str], with_segments: bool) -> None:
    ids, pos, seg = (token_runs.read_tokens(run, k)
                     for k in ("input_ids", "positions", "segment_ids"))

    @nnx.jit
    def sown(model, ids, pos, seg):
        kwargs = {"positions": pos, "segment_ids": seg} if with_segments else {}
        return flax_models.sown(model, ids, **kwargs)

    stored = {name: token_runs.read_activation(run, name) for name in names}
    for r in range(len(ids)):
        want = sown(model, ids[r:r + 1], pos[r:r + 1], seg[r:r + 1])
        for name in names:
            np.testing.assert_array_equal(stored[name][r], np.asarray(want[name])[0],
                                          err_msg=f"{name} row {r}")


def _submit(cfg: str, job: str) -> str:
    out = io.StringIO()
    assert cli.main(["submit", cfg, "--job", job], out=out) == 0, out.getvalue()
    return out.getvalue()


def test_masked_decoder_segmented_on_a_two_host_replica(tmp_path, qwen_tokenizer_dir):
    hooks = "blocks.*:output,blocks.1.mlp:output,blocks.0-1.attn:input"
    cfg = _config(tmp_path, qwen_tokenizer_dir, "tests.flax_models:make_masked_decoder",
                  {"mode": "segmented"}, hooks,
                  # 4 rows over 2 hosts x 2 devices: one row per device.
                  {"hosts": 2, "hosts_per_replica": 2, "batch_size": 4})
    text = _submit(cfg, "fm")
    assert "(1 replica(s) x 2 host(s)" in text
    run = str(tmp_path / "run")
    s = store.open_store(run)
    n = len(s.read_json("manifest.json")["partitions"]["id"])
    assert commit.committed_partitions(s) == set(range(n)) and n >= 2
    assert commit.read_marker(s, 0).hosts == ("r0h0", "r0h1")
    names = ["blocks.0.attn:input", "blocks.0:output", "blocks.1.attn:input",
             "blocks.1.mlp:output", "blocks.1:output", "blocks.2:output"]
    assert sorted(s.read_json("activations/actx.json")["hooks"]) == names
    seg = token_runs.read_tokens(run, "segment_ids")
    assert (seg.max(axis=1) >= 2).any()  # some rows hold several documents
    _assert_hooks_equal_sown(run, flax_models.make_masked_decoder(), names, True)
    assert cli.main(["verify", run], out=io.StringIO()) == 0


def test_plain_decoder_pad_on_two_hosts_and_segmented_refused(tmp_path, qwen_tokenizer_dir,
                                                              capsys):
    factory = "tests.flax_models:make_plain_decoder"
    refused = _config(tmp_path, qwen_tokenizer_dir, factory, {"mode": "segmented"},
                      "blocks.*:output", {"hosts": 2, "batch_size": 2})
    assert cli.main(["submit", refused, "--job", "no"], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert 'packing.mode="segmented": the Flax model ' in err
    assert 'use packing.mode="pad" with packing.overflow="truncate"' in err
    assert not (tmp_path / "run").exists()  # refused before anything was prepared

    cfg = _config(tmp_path, qwen_tokenizer_dir, factory, {"mode": "pad"},
                  "blocks.0-1:output,blocks.2.mlp:output", {"hosts": 2, "batch_size": 2})
    text = _submit(cfg, "fp")
    assert "2 worker process(es) (2 replica(s) x 1 host(s)" in text
    run = str(tmp_path / "run")
    s = store.open_store(run)
    n = len(s.read_json("manifest.json")["partitions"]["id"])
    assert commit.committed_partitions(s) == set(range(n))
    seg = token_runs.read_tokens(run, "segment_ids")
    assert seg.max() == 1 and (seg == 0).any()  # one document per row, padded
    names = ["blocks.0:output", "blocks.1:output", "blocks.2.mlp:output"]
    _assert_hooks_equal_sown(run, flax_models.make_plain_decoder(), names, False)
    assert cli.main(["verify", run], out=io.StringIO()) == 0

    from actx import reader

    opened = reader.open_run(run)
    assert opened.hook("blocks.2.mlp:output").hidden == flax_models.D
    rows = opened.select("blocks.0:output", whole_document=True)  # every stored token here
    valid = seg > 0
    np.testing.assert_array_equal(
        np.asarray(rows.acts["blocks.0:output"]),
        token_runs.read_activation(run, "blocks.0:output")[valid])

    # Beam extraction of the same token store (one row per device, as above): same bytes.
    beam_run = worker_procs.copy_token_store(run, str(tmp_path / "beam-run"))
    code, out = worker_procs.finish(subprocess.Popen(
        [sys.executable, "-m", "actx.adapters.beam_extract", "--run", beam_run, "--batch-size", "2",
         "--job", "beam", "--runner=FnApiRunner"], env=worker_procs.worker_env(2),
        cwd=worker_procs.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        timeout=600)
    assert code == 0, out
    worker_procs.assert_same_activations(beam_run, run)

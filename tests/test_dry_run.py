"""`actx submit --dry-run` on the local target: the plan, and what the job costs (tokens,
rows, each hook's bytes and objects, the objects in all), writing nothing; the figures are
then those of the real submit of the same config (its manifest, the activation arrays as
the reader reads them, the objects on disk)."""

from __future__ import annotations

import io
import json
import os
import re

import numpy as np
import pytest
import yaml

from actx.deploy import cli
from actx.schemas import layout
from tests import hf_models


@pytest.fixture
def config(tmp_path, qwen_tokenizer_dir) -> tuple[str, str]:
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", vocab_size=151936,
                                           num_hidden_layers=2)
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"note {i} " + "words here " * (i % 7 + 1)})
                             + "\n" for i in range(60)))
    run = str(tmp_path / "run")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "run": run,
        "spec": {"name": "dry", "model": {"path": str(model)},
                 "tokenizer": {"path": qwen_tokenizer_dir},
                 "sources": [{"kind": "text", "paths": [str(texts)]}],
                 "packing": {"seq_len": 32},
                 "layout": {"rows_per_shard": 2, "partition_rows": 4},
                 "capture": {"hooks": "layers.*.resid_post", "dtype": "bfloat16"}},
        "target": {"kind": "local", "hosts": 2, "batch_size": 4}}))
    return str(path), run


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def test_dry_run_prints_the_plan_and_the_cost_and_the_submit_matches_it(config, tmp_path):
    path, run = config
    out = io.StringIO()
    assert cli.main(["submit", path, "--dry-run", "--job", "j"], out=out) == 0, out.getvalue()
    said = out.getvalue()
    assert not os.path.exists(run)  # nothing written
    assert f"prepare: {run} (in-process Beam runner" in said
    assert ("extract: job j: 2 worker process(es) (2 replica(s) x 1 host(s), 1 CPU device(s) "
            "each), batch 4") in said
    tokens, rows, seq_len, partitions = map(_int, re.search(
        r"tokens: ([\d,]+) in ([\d,]+) rows of ([\d,]+) \(([\d,]+) partitions", said).groups())
    hooks = dict(re.findall(r"#   (layers\.\d\.resid_post): (\[.*)", said))
    assert sorted(hooks) == ["layers.0.resid_post", "layers.1.resid_post"]
    objects = _int(re.search(r"; ([\d,]+) objects \(", said).group(1))

    # --estimate: one worker timed over a temporary copy's first partitions; the time is
    # the start-up plus the tokens at its steady rate over the job's 2 replicas.
    out = io.StringIO()
    assert cli.main(["submit", path, "--dry-run", "--estimate"], out=out) == 0
    line = next(x for x in out.getvalue().splitlines() if x.startswith("# estimate:"))
    m = re.match(r"# estimate: about (?:(\d+)m)?(\d+)s for ([\d,]+) tokens: one replica ran "
                 r"([\d,]+) tokens/s here in steady state \(timed over \d+ partition\(s\) after a "
                 r"start-up of (?:(\d+)m)?(\d+)s\), x 2 replica\(s\)", line)
    assert m, line
    seconds = int(m.group(1) or 0) * 60 + int(m.group(2))
    startup = int(m.group(5) or 0) * 60 + int(m.group(6))
    assert _int(m.group(3)) == tokens and _int(m.group(4)) > 0
    assert abs(seconds - (startup + tokens / (_int(m.group(4)) * 2))) <= 1.5, line
    assert not os.path.exists(run)  # timed on a copy; the run is not written
    code = cli.main(["submit", path, "--estimate"], out=io.StringIO())
    assert code == 2 and not os.path.exists(run)

    out = io.StringIO()
    assert cli.main(["submit", path, "--job", "j"], out=out) == 0, out.getvalue()
    manifest = json.load(open(os.path.join(run, "manifest.json")))
    assert (manifest["total_tokens"], manifest["total_rows"], manifest["seq_len"]) == (
        tokens, rows, seq_len)
    assert len(manifest["partitions"]["id"]) == partitions
    stored_objects = 0
    for hook, line in hooks.items():
        shape, dtype, size, shards = re.match(
            r"\[([\d, ]+)\] (\w+) = ([\d.,]+ \w+) in ([\d,]+) objects", line).groups()
        # The array as stored (its zarr metadata): shape and dtype, hence its bytes.
        meta = json.load(open(os.path.join(run, layout.ACTIVATIONS_GROUP, hook, "zarr.json")))
        assert meta["shape"] == [_int(x) for x in shape.split(", ")]
        assert dtype == meta["data_type"] == "bfloat16"
        assert size == f"{int(np.prod(meta['shape'])) * 2 / 2**10:,.1f} KiB"
        files = [f for d, _, fs in os.walk(os.path.join(run, layout.ACTIVATIONS_GROUP, hook))
                 for f in fs if f != "zarr.json"]
        assert len(files) == _int(shards)
        stored_objects += len(files) + 1
    stored_objects += len(os.listdir(os.path.join(run, layout.COMMITS_PREFIX)))
    assert stored_objects == objects


def _cost(argv: list[str]) -> tuple[str, dict]:
    out = io.StringIO()
    assert cli.main(argv, out=out) == 0, out.getvalue()
    said = out.getvalue()
    m = re.search(r"tokens: ([\d,]+) in ([\d,]+) rows of [\d,]+ \(([\d,]+) partitions; ([^)]*)\)",
                  said)
    assert m, said
    return said, {"tokens": _int(m.group(1)), "rows": _int(m.group(2)),
                  "partitions": _int(m.group(3)), "source": m.group(4)}


def test_a_tpu_target_counts_the_inputs_and_bounds_the_time_by_its_peak(config, tmp_path):
    """Off the local target the dry run counts the same tokens; `--estimate` cannot time
    a TPU from here, so it gives the least time the slice's peak allows."""
    from actx.deploy import cost_bound
    from actx.workers.model import families

    path, run = config
    _, local = _cost(["submit", path, "--dry-run"])
    data = yaml.safe_load(open(path))
    data["run"] = "gs://b/runs/dry"
    data["target"] = {"kind": "tpu-vm", "batch_size": 8,
                      "tpu": {"name": "t", "zone": "z", "project": "p",
                              "accelerator_type": "v4-8"}}
    tpu = tmp_path / "tpu.yaml"
    tpu.write_text(yaml.safe_dump(data))
    said, counted = _cost(["submit", str(tpu), "--dry-run", "--estimate"])
    assert counted == local, said
    line = next(x for x in said.splitlines() if x.startswith("# estimate:"))
    model = families.config_from_hf(json.load(open(os.path.join(data["spec"]["model"]["path"],
                                                           "config.json"))))
    per_token = cost_bound.forward_flops_per_token(model, 2, 32)  # both layers hooked
    assert line == (f"# estimate: at least 0s for {local['tokens']:,} tokens on a v4-8 (4 chips "
                    f"x 275 TFLOP/s bf16): {per_token / 1e9:,.2f} GFLOP per token over 2 "
                    f"block(s) at full peak; a forward pass reaches a fraction of peak, which "
                    f"only a run on that hardware measures"), line


@pytest.mark.parametrize("capped", [False, True])
def test_inputs_over_the_limit_are_sampled_by_files_and_scaled(config, tmp_path, monkeypatch,
                                                               capped):
    """Past the limit, each source's first files stand for it, scaled by its bytes; a
    source with max_docs is counted whole (its prepare stops there)."""
    from actx.deploy import dry_run

    path, _ = config
    data = yaml.safe_load(open(path))
    folder = tmp_path / "many"
    folder.mkdir()
    for f in range(6):  # six files alike: a sample of two stands for all six
        (folder / f"{f}.jsonl").write_text("".join(
            json.dumps({"text": f"file {f} note {i} " + "words here " * (i % 7 + 1)}) + "\n"
            for i in range(40)))
    data["spec"]["sources"] = [{"kind": "text", "paths": [str(folder)]}] + (
        [{"kind": "text", "paths": [str(folder)], "max_docs": 30, "name": "capped"}]
        if capped else [])
    many = tmp_path / "many.yaml"
    many.write_text(yaml.safe_dump(data))
    _, whole = _cost(["submit", str(many), "--dry-run"])
    assert whole["source"] == "counted by a prepare of the inputs into memory"
    size = sum(os.path.getsize(folder / f"{f}.jsonl") for f in range(6))
    monkeypatch.setattr(dry_run, "COUNT_INPUT_BYTES", size // 3)
    said, sampled = _cost(["submit", str(many), "--dry-run"])
    assert sampled["source"].startswith(
        f"estimated: {8 if capped else 2} of {12 if capped else 6} input files"), said
    assert abs(sampled["tokens"] - whole["tokens"]) <= 0.05 * whole["tokens"], (sampled, whole)
    assert abs(sampled["rows"] - whole["rows"]) <= 0.1 * whole["rows"] + 1, (sampled, whole)

"""A generating run on a simulated two-host TPU slice (v4-16: 2 hosts x 4 chips; the
simulated cloud of tests/fake_gcloud.py, fake-gcs-server): `actx submit --wait` to the
tpu-vm target runs the real workers on both hosts, joined by jax.distributed and
generating in lockstep, and what they store is byte for byte what one local process with
the slice's 8 devices stores for the same spec (workers/generate/worker.py)."""

from __future__ import annotations

import io
import uuid

import yaml

from actx.deploy import cli
from actx.schemas import commit, store
from tests import generate_runs
from tests.fake_gcloud_fixtures import fake_cloud, pod_config  # noqa: F401 (fixture)

STOP = generate_runs.STOP


def _main(argv) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main([str(a) for a in argv], out=out)
    return code, out.getvalue()


def _objects(s) -> dict[str, bytes]:
    return {k: s.read(k) for prefix in ("activations/", "generated/") for k in s.list(prefix)
            if not k.endswith("actx.json")}  # the numerics record names hosts and devices


def test_a_two_host_slice_generates_what_one_local_process_does(
        tmp_path, fake_cloud, gcs_bucket, qwen_tokenizer_dir):
    model = generate_runs.tiny_qwen2(tmp_path / "qwen2")
    prompts = generate_runs.write_prompts(tmp_path / "prompts.jsonl",
                                          generate_runs.PROMPTS[:2] + generate_runs.PROMPTS[4:])
    run = f"{gcs_bucket}/runs/gen"
    path = pod_config(tmp_path / "pod.yaml", run, model, qwen_tokenizer_dir, [],
                      accelerator_type="v4-16", batch_size=8)
    cfg = yaml.safe_load(open(path))
    cfg["spec"] = generate_runs.spec_dict(
        model, qwen_tokenizer_dir, prompts, max_context=96, rows_per_shard=1,
        partition_rows=2, max_new_tokens=12, temperature=1.0, top_k=50,
        samples_per_prompt=2, seed=5, stop_token_ids=[STOP])
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    code, out = _main(["submit", path, "--job", f"g-{uuid.uuid4().hex[:6]}", "--wait"])
    assert code == 0, out
    s = store.open_store(run)
    n = len(s.read_json("manifest.json")["partitions"]["id"])
    assert len(s.list("commits/")) == n >= 2
    assert commit.read_marker(s, 0).hosts == ("r0h0", "r0h1")  # one replica of two hosts
    code, out = _main(["verify", run])
    assert code == 0, out

    cfg["run"] = str(tmp_path / "local")
    cfg["target"] = {"kind": "local", "hosts": 1, "devices_per_host": 8, "batch_size": 8}
    local = tmp_path / "local.yaml"
    local.write_text(yaml.safe_dump(cfg))
    code, out = _main(["submit", local])
    assert code == 0, out
    ours, ref = _objects(s), _objects(store.open_store(cfg["run"]))
    assert any("generated.token_ids" in k for k in ref) and any(
        k.startswith("generated/") for k in ref)
    assert ours == ref
    assert _main(["down", "--config", path])[0] == 0

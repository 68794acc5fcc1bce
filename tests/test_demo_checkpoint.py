"""The demo's random Qwen2, written with numpy + safetensors (deploy.demo), against
transformers: the same files, names, shapes and config that `save_pretrained` writes, and
the same activations from HF's Qwen2ForCausalLM as from actx's model."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from actx.deploy import demo
from tests import hf_models
from actx.workers.model import capture, step
from actx.workers.model import decoder as model_lib

ALL_HOOKS = ("layers.*.resid_pre,layers.*.resid_mid,layers.*.resid_post,"
             "layers.*.attn_out,layers.*.mlp_out,embed,final_norm")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _safetensors_header(path: str) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def _layout(header: dict) -> dict:
    """Name -> (dtype, shape), plus the metadata, of a safetensors header."""
    return {k: v if k == "__metadata__" else (v["dtype"], tuple(v["shape"]))
            for k, v in header.items()}


def _json(path: str) -> dict:
    with open(path) as f:
        obj = json.load(f)
    obj.pop("transformers_version", None)
    return obj


def _hf_save_pretrained(out: str, **qwen2_kwargs) -> str:
    """The reference: transformers' own Qwen2ForCausalLM, saved by save_pretrained."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, **qwen2_kwargs)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.parametrize("overrides, hf_kwargs", [
    ({}, dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
              rms_norm_eps=1e-6, rope_theta=1000000.0)),
    (dict(vocab_size=1000, hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=3,
          intermediate_size=160, max_position_embeddings=8192, rope_theta=10000.0,
          rms_norm_eps=1e-5),
     dict(vocab_size=1000, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
          num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=8192,
          rms_norm_eps=1e-5, rope_theta=10000.0)),
], ids=["demo", "overridden"])
def test_files_are_what_save_pretrained_writes(tmp_path, overrides, hf_kwargs):
    ours = demo.write_qwen2_checkpoint(str(tmp_path / "ours"), demo.qwen2_config(**overrides))
    ref = _hf_save_pretrained(str(tmp_path / "ref"), **hf_kwargs)
    assert sorted(os.listdir(ours)) == sorted(os.listdir(ref))
    for name in ("config.json", "generation_config.json"):
        assert _json(os.path.join(ours, name)) == _json(os.path.join(ref, name)), name
    assert (_layout(_safetensors_header(os.path.join(ours, "model.safetensors")))
            == _layout(_safetensors_header(os.path.join(ref, "model.safetensors"))))


def test_transformers_loads_it_and_matches_actx(tmp_path):
    import torch
    import transformers

    path = demo.make_tiny_qwen2(str(tmp_path / "qwen2-tiny-random"))
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert type(hf_model).__name__ == "Qwen2ForCausalLM"
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    hf_model.eval()
    # Ids over the whole Qwen2.5 vocabulary, specials included.
    ids = np.random.RandomState(0).randint(0, demo.QWEN25_VOCAB_ROWS, (2, 24)).astype(np.int32)
    ref = hf_models.hf_hooks(hf_model, ids)

    model = model_lib.load_pretrained(path, dtype="float32")
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse(ALL_HOOKS))
    ours = {k: np.asarray(v) for k, v in fn(ids).items()}
    assert sorted(ours) == sorted(ref)
    for name in ref:
        assert ours[name].shape == (2, 24, 64) and ours[name].dtype == np.float32
        max_rel = float(np.max(np.abs(ours[name] - ref[name])) / np.max(np.abs(ref[name])))
        assert max_rel <= 1e-5, name


def test_written_without_torch_or_transformers(tmp_path):
    code = ("import sys; from actx.deploy import demo; demo.make_tiny_qwen2(sys.argv[1]); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert os.path.isfile(tmp_path / "m" / "model.safetensors")

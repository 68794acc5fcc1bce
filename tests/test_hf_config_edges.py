"""Config fields where actx once computed something other than HF transformers without a
word: a quantised checkpoint's integer or float8 weights read as floats, Gemma 3's local
layers' YaRN attention factor, Gemma 3's YaRN truncate given per layer type, GPT-NeoX's
head_dim. Each is now HF's result, or refused by name before any weight is read (gpt-oss's
norms and its empty rope_parameters: tests/test_families_gpt_oss.py)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from actx.workers.model import checkpoint, families
from actx.workers.model import decoder as model_lib
from tests import hf_models
from tests import test_families_gpt as gpt_tests
from tests import test_moe_layouts as layout_tests

HOOKS = ("layers.*.resid_pre,layers.*.resid_mid,layers.*.resid_post,"
         "layers.*.attn_out,layers.*.mlp_out,embed,final_norm")
IDS = np.random.RandomState(2).randint(1, 512, (1, 20)).astype(np.int32)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return hf_models.checkpoint_maker(tmp_path_factory)


# ---- quantization_config ----------------------------------------------------------------

QUANTISED = [
    ({"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False,
      "llm_int8_threshold": 6.0}, "bitsandbytes"),
    # Older bitsandbytes configs say only load_in_4bit / load_in_8bit.
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "bitsandbytes"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "awq"),
]


@pytest.mark.parametrize("quant,method", QUANTISED)
def test_a_quantised_checkpoint_is_refused_naming_its_method(ckpt_dir, tmp_path, quant,
                                                              method):
    """A checkpoint whose config.json has a quantization_config actx does not implement
    (every family's but gpt-oss's mxfp4) is refused when the config is read, naming the
    method as transformers' AutoQuantizationConfig names it, and saying what to use."""
    from transformers.quantizers.auto import AutoQuantizationConfig

    hf_method = AutoQuantizationConfig.from_dict(dict(quant)).quant_method
    assert getattr(hf_method, "value", hf_method) == method
    assert families.quantization_method(quant) == method
    path = gpt_tests._copy_with(ckpt_dir("llama3"), tmp_path / "q",
                                quantization_config=quant)
    with pytest.raises(ValueError, match=rf"quantization_config\.quant_method='{method}' "
                                         r"for LlamaForCausalLM.*unquantised checkpoint"):
        model_lib.load_pretrained(path)


def test_a_multimodal_config_quantised_at_its_top_is_refused():
    """Gemma 3's multimodal config keeps quantization_config beside its text_config."""
    hf = hf_models.tiny_config("gemma3_mm").to_dict()
    hf["architectures"] = ["Gemma3ForConditionalGeneration"]
    families.config_from_hf(hf)
    hf["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(ValueError, match=r"quant_method='bitsandbytes' for "
                                         r"Gemma3ForConditionalGeneration"):
        families.config_from_hf(hf)


def _int8_checkpoint(src, dest, quantization_config=None) -> tuple[str, str]:
    """(a Llama whose projections are int8 with their per-row scales beside them, as
    bitsandbytes saves them; the same model dequantised, in float32)."""
    import torch
    from safetensors.torch import load_file, save_file

    quant, plain = os.path.join(dest, "int8"), os.path.join(dest, "plain")
    shutil.copytree(src, quant)
    shutil.copytree(src, plain)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    packed, unpacked = dict(tensors), dict(tensors)
    for name, weight in tensors.items():
        if name.endswith("_proj.weight"):
            scale = weight.abs().amax(dim=1).clamp(min=1e-8)
            int8 = torch.round(weight / scale[:, None] * 127).to(torch.int8)
            packed[name], packed[name[:-len("weight")] + "SCB"] = int8, scale
            unpacked[name] = int8.float() * scale[:, None] / 127
    save_file(packed, os.path.join(quant, "model.safetensors"), metadata={"format": "pt"})
    save_file(unpacked, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        with open(os.path.join(quant, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = quantization_config
        with open(os.path.join(quant, "config.json"), "w") as f:
            json.dump(config, f)
    return quant, plain


def test_int8_weights_are_never_read_as_floats(ckpt_dir, tmp_path):
    """The bitsandbytes 8-bit checkpoint the Python API once read as floats (its first
    layer's attn_out about 10^7 times HF's on the dequantised weights) is refused by its
    config; with no quantization_config at all, by its first int8 tensor's name."""
    quant, plain = _int8_checkpoint(ckpt_dir("llama3"), tmp_path, QUANTISED[0][0])
    with pytest.raises(ValueError, match=r"quant_method='bitsandbytes'"):
        model_lib.load_pretrained(quant)
    bare, _ = _int8_checkpoint(ckpt_dir("llama3"), tmp_path / "bare")
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.self_attn\.q_proj\."
                                         r"weight' has dtype I8; actx reads float weights"):
        model_lib.load_pretrained(bare)
    # The dequantised model is HF's: only the dtypes were wrong.
    ref = hf_models.hf_hooks(hf_models.load_hf_model(plain), IDS)
    ours = layout_tests._extract(plain, IDS, hooks=HOOKS)
    layout_tests._assert_hooks_equal(ours, ref)


def test_a_float8_tensor_is_refused_by_name_not_by_numpy(ckpt_dir, tmp_path):
    """numpy has no float8: safetensors' numpy reader once failed with an AttributeError
    inside the load."""
    import torch
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(ckpt_dir("llama3"), tmp_path / "f8")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor '{name}' has dtype F8_E4M3; actx reads "
                                         r"float weights.*unquantised checkpoint"):
        model_lib.load_pretrained(str(path))
    with pytest.raises(ValueError, match=rf"tensor {name} has dtype F8_E4M3"):
        checkpoint.TensorReader(str(path)).read(name)


# ---- Gemma 3's RoPE per layer type --------------------------------------------------------

_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
         "original_max_position_embeddings": 4096}


def _gemma3(tmp_path, name, sliding, full):
    return hf_models.make_tiny_checkpoint(tmp_path / name, "gemma3", rope_parameters={
        "sliding_attention": sliding, "full_attention": full})


def test_gemma3_local_yarn_scales_cos_and_sin_by_its_attention_factor(tmp_path):
    """HF's Gemma3RotaryEmbedding multiplies each layer type's cos and sin by that type's
    attention factor (YaRN's 0.1 ln(8) + 1 = 1.21 here): the local layers' too (actx once
    left theirs at 1, 0.43 of attn_out away from HF)."""
    path = _gemma3(tmp_path, "local", _YARN, {"rope_type": "default", "rope_theta": 1e6})
    cfg = hf_models.actx_config(path)
    assert cfg.local_rope.attention_factor == pytest.approx(0.1 * np.log(8.0) + 1)
    ref = hf_models.hf_hooks(hf_models.load_hf_model(path), IDS)
    layout_tests._assert_hooks_equal(layout_tests._extract(path, IDS, hooks=HOOKS), ref)
    # The factor moves HF's result: the same weights with a factor of 1 stated.
    unscaled = _gemma3(tmp_path, "unscaled", {**_YARN, "attention_factor": 1.0},
                       {"rope_type": "default", "rope_theta": 1e6})
    other = hf_models.hf_hooks(hf_models.load_hf_model(unscaled), IDS)
    assert gpt_tests._max_rel(other["layers.0.attn_out"], ref["layers.0.attn_out"]) > 1e-2


def test_gemma3_yarn_truncate_is_read_from_the_top_of_rope_parameters(tmp_path):
    """transformers 5.25 reads YaRN's truncate from the top level of rope_parameters, which
    for Gemma 3 is the dict of layer types: a layer type's own `truncate: false` is not
    read, and YaRN truncates (the ramp over whole dims), in HF as here."""
    path = _gemma3(tmp_path, "nested", {"rope_type": "default", "rope_theta": 10000.0},
                   {**_YARN, "truncate": False})
    assert hf_models.actx_config(path).rope.truncate is True
    ref = hf_models.hf_hooks(hf_models.load_hf_model(path), IDS)
    layout_tests._assert_hooks_equal(layout_tests._extract(path, IDS, hooks=HOOKS), ref)
    # HF's result is the truncated ramp's (actx once read the layer type's false: 2e-3 of
    # attn_out away).
    truncated = _gemma3(tmp_path, "truncated", {"rope_type": "default", "rope_theta": 1e4},
                        {**_YARN, "truncate": True})
    same = hf_models.hf_hooks(hf_models.load_hf_model(truncated), IDS)
    for name in ref:
        np.testing.assert_array_equal(same[name], ref[name], err_msg=name)


# ---- GPT-NeoX's head_dim -----------------------------------------------------------------

def test_gpt_neox_head_dim_other_than_hidden_over_heads_is_refused(ckpt_dir, tmp_path):
    """HF's GPT-NeoX attention splits heads of hidden / heads (16 here) but builds its
    rotary table from the config's head_dim: head_dim 8 rotates 2 dims at other
    frequencies, which moves HF's result; actx refuses it by name, and reads a head_dim
    equal to hidden / heads as HF does."""
    base = ckpt_dir("gpt_neox")
    ref = hf_models.hf_hooks(hf_models.load_hf_model(base), IDS)
    odd = gpt_tests._copy_with(base, tmp_path / "odd", head_dim=8)
    other = hf_models.hf_hooks(hf_models.load_hf_model(odd), IDS)
    assert gpt_tests._max_rel(other["layers.0.attn_out"], ref["layers.0.attn_out"]) > 1e-4
    with pytest.raises(ValueError, match=r"unsupported option head_dim=8 for "
                                         r"GPTNeoXForCausalLM.*= 16 wide"):
        model_lib.load_pretrained(odd)
    same = gpt_tests._copy_with(base, tmp_path / "same", head_dim=16)
    ref_same = hf_models.hf_hooks(hf_models.load_hf_model(same), IDS)
    ours = gpt_tests._extract(same, IDS)
    layout_tests._assert_hooks_equal(ours, ref_same)


# ---- Llama's attention_bias -----------------------------------------------------------------

def test_llama_attention_biases_are_read_and_mlp_bias_refused(tmp_path):
    """LlamaAttention's q/k/v/o projections carry biases where `attention_bias` (models
    converted to Llama's layout from ones with them); actx reads them. HF initialises
    biases at 0, so they are made random here: a bias left out moves the result. The
    gated MLP's `mlp_bias` is refused by name."""
    from safetensors.numpy import load_file, save_file

    path = hf_models.make_tiny_checkpoint(tmp_path / "llama", "llama3", attention_bias=True)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    rng = np.random.RandomState(0)
    biases = [n for n in tensors if n.endswith("_proj.bias")]
    assert {n.split(".")[-2] for n in biases} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    for name in biases:
        tensors[name] = (0.5 * rng.randn(*tensors[name].shape)).astype(tensors[name].dtype)
    save_file(tensors, file, metadata={"format": "pt"})
    ref = hf_models.hf_hooks(hf_models.load_hf_model(path), IDS)
    layout_tests._assert_hooks_equal(layout_tests._extract(path, IDS, hooks=HOOKS), ref)
    unbiased = hf_models.make_tiny_checkpoint(tmp_path / "zero", "llama3", attention_bias=True)
    other = hf_models.hf_hooks(hf_models.load_hf_model(unbiased), IDS)
    assert gpt_tests._max_rel(other["layers.0.attn_out"], ref["layers.0.attn_out"]) > 1e-2
    mlp = hf_models.make_tiny_checkpoint(tmp_path / "mlp", "llama3", mlp_bias=True)
    with pytest.raises(ValueError, match=r"unsupported option mlp_bias=True for "
                                         r"LlamaForCausalLM"):
        model_lib.load_pretrained(mlp)

"""gpt-oss against HF transformers run on each document alone: every hook of every token
(the router's included), in float32 and bfloat16, documents alone, in segmented rows and
through the KV carry; the attention sinks in every attention way (the kernels fall back
to XLA, saying so); every config setting it reads is shown to move HF's result; MXFP4
checkpoints are dequantised as transformers' own helper does."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest

from actx.schemas import runspec
from actx.workers.model import capture, checkpoint, checkpoint_check, mxfp4, step
from actx.workers.model import decoder as model_lib
from tests import hf_models
from tests import test_families_gpt as gpt_tests
from tests import test_long_documents as long_docs
from tests import test_moe_layouts as layout_tests

SEQ = 24
ALL_HOOKS = layout_tests.ALL_HOOKS


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return hf_models.checkpoint_maker(tmp_path_factory)


def _config(path):
    return hf_models.actx_config(path)


def test_family_table_names_exactly_the_decoder_tensors_hf_saves(ckpt_dir):
    path = ckpt_dir("gpt_oss")
    cfg = _config(path)
    reader = checkpoint.TensorReader(path)
    saved = {n for n in reader._file_of if n.startswith("model.")}
    assert set(checkpoint_check.needed_tensors(cfg, "model.")) == saved
    params = checkpoint.load_params(reader, cfg, np.float32)["layers"]
    # gate_up_proj [e, d, 2f] interleaves gate (even columns) and up (odd ones).
    fused = reader.read("model.layers.1.mlp.experts.gate_up_proj")
    np.testing.assert_array_equal(np.asarray(params["expert_gate_ledf"][1]), fused[:, :, 0::2])
    np.testing.assert_array_equal(np.asarray(params["expert_up_ledf"][1]), fused[:, :, 1::2])
    assert cfg.window_per_layer == (6, None, 6)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.attention_factor > 1


@pytest.mark.parametrize("impl", ["blocked", "ragged", "dense"])
def test_each_document_alone_and_in_segmented_rows_match_hf(ckpt_dir, monkeypatch, impl):
    """Every hook of every token: documents of 9 and 11 tokens share a row, one of 24
    fills another (each longer than the window of 6), each equal to HF on it alone."""
    monkeypatch.setattr(model_lib, "EXPERT_MATMULS", impl)
    path = ckpt_dir("gpt_oss")
    hf = hf_models.load_hf_model(path)
    docs, ids, pos, seg = hf_models.segmented_rows(SEQ)
    ours = layout_tests._extract(path, ids, positions=pos, segment_ids=seg)
    for row, start, doc in ((0, 0, docs[0]), (0, 9, docs[1]), (1, 0, docs[2])):
        ref = hf_models.hf_hooks(hf, doc[None])
        got = {k: v[row, start:start + len(doc)][None] for k, v in ours.items()}
        layout_tests._assert_hooks_equal(got, ref, f"row {row} start {start}")


def test_bfloat16_parity(ckpt_dir):
    layout_tests.test_bfloat16_parity(ckpt_dir, "gpt_oss")


def _bf16_ulps(got, want) -> np.ndarray:
    """|got - want| in units of bfloat16's last place at the larger of the two (both
    bfloat16 values, given as float32)."""
    big = np.maximum(np.abs(got), np.abs(want))
    ulp = np.exp2(np.floor(np.log2(np.maximum(big, np.finfo(np.float32).tiny))) - 7)
    return np.abs(got - want) / ulp


def test_every_norm_scales_in_float32_as_hf_in_bfloat16(ckpt_dir):
    """GptOssRMSNorm multiplies the float32-normalised input by its weight in float32 and
    casts last ("main diff with Llama"), which casts first and multiplies in bfloat16.
    Each of our norms (every block's input and post-attention norms, and the final one),
    in bfloat16 on the same bfloat16 input, equals HF's module in bfloat16 but for at
    most 1 element in 1,000, one bfloat16 ulp away (float32 sums in another order). Cast
    first, a quarter of the elements differed (by one ulp)."""
    import jax
    import jax.numpy as jnp
    import torch

    path = ckpt_dir("gpt_oss")
    hf = hf_models.load_hf_model(path).to(torch.bfloat16)
    model = model_lib.load_pretrained(path, dtype="bfloat16")
    cfg = model.config
    x = torch.from_numpy(3 * np.random.RandomState(0).randn(4, 256, cfg.hidden_size)
                         .astype(np.float32)).to(torch.bfloat16)
    x_btd = jnp.asarray(x.float().numpy()).astype(jnp.bfloat16)
    pairs = [(hf.model.norm, model_lib.final_norm(model.params, cfg, x_btd), "final")]
    for i, layer in enumerate(hf.model.layers):
        p = jax.tree.map(lambda w, i=i: w[i], model.params["layers"])
        pairs += [(layer.input_layernorm, model_lib.norm(x_btd, p, "attn_norm_ld", cfg),
                   f"layers.{i}.input_layernorm"),
                  (layer.post_attention_layernorm,
                   model_lib.norm(x_btd, p, "mlp_norm_ld", cfg),
                   f"layers.{i}.post_attention_layernorm")]
    for module, ours, name in pairs:
        assert ours.dtype == jnp.bfloat16, name
        with torch.no_grad():
            want = module(x).float().numpy()
        got = np.asarray(ours.astype(jnp.float32))
        ulps = _bf16_ulps(got, want)
        assert np.mean(ulps > 0) <= 1e-3 and np.max(ulps) <= 1, (
            name, np.mean(ulps > 0), np.max(ulps))


def test_empty_rope_parameters_are_plain_rope_as_in_hf(ckpt_dir, tmp_path):
    """GptOssConfig takes its default YaRN (factor 32) only where rope_parameters is
    missing or null: an empty one is plain RoPE at the class's theta there, and here;
    the two differ in HF's result."""
    base = ckpt_dir("gpt_oss")
    ids = np.random.RandomState(2).randint(1, 512, (1, 20)).astype(np.int32)
    empty = gpt_tests._copy_with(base, tmp_path / "empty", rope_parameters={})
    missing = gpt_tests._copy_with(base, tmp_path / "missing", rope_parameters=None)
    refs = {}
    for path, rope_type in ((empty, "default"), (missing, "yarn")):
        assert _config(path).rope.rope_type == rope_type
        refs[rope_type] = hf_models.hf_hooks(hf_models.load_hf_model(path), ids)
        layout_tests._assert_hooks_equal(layout_tests._extract(path, ids), refs[rope_type],
                                         rope_type)
    assert gpt_tests._max_rel(refs["default"]["layers.2.mlp_out"],
                              refs["yarn"]["layers.2.mlp_out"]) > 1e-3


@pytest.mark.parametrize("way", ["xla", "pallas_gpu", "pallas_tpu", "cudnn"])
def test_long_documents_through_the_cache_match_hf(tmp_path, monkeypatch, caplog, way):
    """Documents of up to 12 rows through the chain schedule and the KV carry: the sinks
    join every query's denominator once, over the row and the cached blocks together.
    The kernels have no sinks: asked for, they give way to XLA with a log line."""
    max_context = 24
    impl = long_docs._use_way(monkeypatch, way) if way.startswith("pallas") else way
    path = hf_models.make_tiny_checkpoint(tmp_path / "oss", "gpt_oss")
    hf = hf_models.load_hf_model(path)
    model = model_lib.load_pretrained(path)
    with caplog.at_level(logging.WARNING):
        fn = step.make_extract_fn(
            model, capture.CaptureSpec.parse(long_docs.HOOKS + "," + layout_tests.ROUTER),
            max_context=max_context, attention_impl=impl)
        docs = long_docs._documents(0, max_context)
        block = long_docs._packed(docs, runspec.PackingSpec(
            "segmented", long_docs.SEQ_LEN, max_context=max_context))
        stored = long_docs.run_rows(fn, block, local_batch=3)
    if way != "xla":
        assert f"{way} has no attention sinks" in caplog.text
    long_docs.assert_documents_match_hf(stored, block, docs, hf, max_context, rtol=1e-5)


def _with_setting(tmp_path, **fields):
    return hf_models.make_tiny_checkpoint(tmp_path / "with", "gpt_oss", **fields)


# (the setting, the base config's value where the weights do not depend on it).
SETTINGS = [
    ({"sliding_window": 4}, {"sliding_window": 4096}),
    ({"layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
     {"layer_types": ["full_attention"] * 3}),
    ({"swiglu_limit": 0.5}, {"swiglu_limit": 7.0}),
    ({"swiglu_alpha": 1.0}, {"swiglu_alpha": 1.702}),
    ({"num_experts_per_tok": 3}, {"num_experts_per_tok": 1}),
    # The ramp over dims 2.6-5.6 (beta 32, 1) against 3.8-5.0 (beta 8, 2) at 4096.
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                          "beta_fast": 8.0, "beta_slow": 2.0, "truncate": False,
                          "original_max_position_embeddings": 4096}},
     {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                          "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                          "original_max_position_embeddings": 4096}}),
    # truncate: the ramp over dims 3-6 against 2.6-5.6.
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                          "truncate": True, "original_max_position_embeddings": 4096}},
     {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                          "truncate": False, "original_max_position_embeddings": 4096}}),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                          "truncate": False, "original_max_position_embeddings": 256,
                          "attention_factor": 0.5}},
     {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                          "truncate": False, "original_max_position_embeddings": 256}}),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 16.0,
                          "truncate": True, "original_max_position_embeddings": 8}},
     {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
    ({"attention_bias": False}, None),
    ({"rms_norm_eps": 0.5}, {"rms_norm_eps": 1e-5}),
]


@pytest.mark.parametrize("setting,base", SETTINGS)
def test_every_setting_read_moves_the_result(tmp_path, setting, base):
    """With the setting, ours equals HF; HF with the same weights and the setting at its
    base value differs by far more than that tolerance, so a decoder that ignored the
    setting would fail (attention_bias changes which tensors there are: read by the
    load)."""
    path = _with_setting(tmp_path, **setting)
    ids = np.random.RandomState(2).randint(1, 512, (1, 20)).astype(np.int32)
    ref = hf_models.hf_hooks(hf_models.load_hf_model(path), ids)
    ours = layout_tests._extract(path, ids)
    layout_tests._assert_hooks_equal(ours, ref, str(setting))
    if base is None:
        return
    without = gpt_tests._copy_with(path, tmp_path / "without", **base)
    other = hf_models.hf_hooks(hf_models.load_hf_model(without), ids)
    moved = max(gpt_tests._max_rel(other[name], ref[name]) for name in ref
                if name != "embed" and not name.endswith("expert_ids"))
    assert moved > 1e-4, (setting, moved)


def test_the_sinks_and_biases_move_the_result(ckpt_dir, tmp_path):
    """Weights, not settings: HF with the sinks at -inf-like (no sink), or the router's
    and experts' biases at zero, differs from HF with them, and ours follows each."""
    from safetensors.numpy import load_file, save_file

    path = ckpt_dir("gpt_oss")
    ids = np.random.RandomState(4).randint(1, 512, (1, 20)).astype(np.int32)
    ref = hf_models.hf_hooks(hf_models.load_hf_model(path), ids)
    for suffix, value in (("self_attn.sinks", -1e4), ("mlp.router.bias", 0.0),
                          ("gate_up_proj_bias", 0.0), ("down_proj_bias", 0.0)):
        dest = tmp_path / suffix.replace(".", "_")
        shutil.copytree(path, dest)
        file = os.path.join(dest, "model.safetensors")
        tensors = load_file(file)
        for name in tensors:
            if name.endswith(suffix):
                tensors[name] = np.full_like(tensors[name], value)
        save_file(tensors, file, metadata={"format": "pt"})
        other = hf_models.hf_hooks(hf_models.load_hf_model(str(dest)), ids)
        moved = max(gpt_tests._max_rel(other[n], ref[n]) for n in ref
                    if n != "embed" and not n.endswith("expert_ids"))
        assert moved > 1e-3, (suffix, moved)
        layout_tests._assert_hooks_equal(layout_tests._extract(str(dest), ids), other, suffix)


def _mxfp4_checkpoint(path, dest, seed=0) -> tuple[str, str]:
    """(an MXFP4 checkpoint of `path`'s model whose experts are random MXFP4 blocks and
    scales, the same model unquantised with transformers' own dequantisation of them)."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations import mxfp4 as hf_mxfp4

    rng = np.random.default_rng(seed)
    quant, plain = dest / "mxfp4", dest / "plain"
    shutil.copytree(path, quant)
    shutil.copytree(path, plain)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    packed, unpacked = {}, {}
    for name, value in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name] = unpacked[name] = value
            continue
        blocks_shape, scales_shape = mxfp4.packed_shapes(value.shape)
        blocks = rng.integers(0, 256, blocks_shape, dtype=np.uint8)
        # Powers of two from 1/64 to 1/8 (and a few extremes), so the weights are of the
        # model's scale and every exponent path is taken.
        scales = rng.integers(127 - 6, 127 - 2, scales_shape).astype(np.uint8)
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        reference = hf_mxfp4.convert_moe_packed_tensors(
            torch.as_tensor(blocks), torch.as_tensor(scales), dtype=torch.float32)
        unpacked[name] = reference.numpy()
        assert unpacked[name].shape == value.shape
    save_file(packed, os.path.join(quant, "model.safetensors"), metadata={"format": "pt"})
    save_file(unpacked, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(quant, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                "model.layers.*.mlp.router",
                                                                "model.embed_tokens",
                                                                "lm_head"]}
    with open(os.path.join(quant, "config.json"), "w") as f:
        json.dump(config, f)
    return str(quant), str(plain)


def test_mxfp4_experts_are_dequantised_as_transformers_does(ckpt_dir, tmp_path):
    """A checkpoint written in the Hub's format (`*_blocks` uint8 [e, rows, groups, 16],
    `*_scales` uint8 [e, rows, groups], quant_method mxfp4) loads into the weights
    transformers' `convert_moe_packed_tensors` gives, in float32 and bfloat16, and every
    hook equals HF run on those weights."""
    quant, plain = _mxfp4_checkpoint(ckpt_dir("gpt_oss"), tmp_path)
    cfg = _config(quant)
    assert cfg.mxfp4_experts
    needed = checkpoint_check.needed_tensors(cfg, "model.")
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in needed
    assert checkpoint_check.problems(quant, cfg) == ([], [])
    for dtype in (np.float32, "bfloat16"):
        ours = checkpoint.load_params(checkpoint.TensorReader(quant), cfg, dtype)["layers"]
        want = checkpoint.load_params(checkpoint.TensorReader(plain), _config(plain),
                                      dtype)["layers"]
        for name in ("expert_gate_ledf", "expert_up_ledf", "expert_down_lefd"):
            np.testing.assert_array_equal(np.asarray(ours[name]), np.asarray(want[name]))
    ids = np.random.RandomState(6).randint(1, 512, (1, 20)).astype(np.int32)
    ref = hf_models.hf_hooks(hf_models.load_hf_model(plain), ids)
    layout_tests._assert_hooks_equal(layout_tests._extract(quant, ids), ref)


def test_other_quantisations_are_refused_by_name(ckpt_dir, tmp_path):
    path = gpt_tests._copy_with(ckpt_dir("gpt_oss"), tmp_path / "q",
                                quantization_config={"quant_method": "fp8"})
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method='fp8'"):
        model_lib.load_pretrained(path)


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen2_moe", "qwen3_moe_mixed"])
def test_generation_equals_hf_greedy(ckpt_dir, arch):
    """Generation's own attention over each slot's cache honours the sinks and the
    windows: greedy ids equal HF generate's, every activation HF's forward over prompt
    and continuation (tests/test_generate.py's check; the mixtures with dense layers and
    the shared expert through the same step)."""
    from tests import test_generate as generate_tests

    generate_tests.test_greedy_tokens_and_activations_equal_hf(ckpt_dir, arch)


def test_generation_asked_for_the_decode_kernel_uses_xla_with_the_sinks(ckpt_dir, caplog):
    from actx.workers.generate import step as generate_step

    cfg = _config(ckpt_dir("gpt_oss"))
    with caplog.at_level(logging.WARNING):
        assert generate_step.attention_for("bfloat16", cfg, 64, requested="pallas") == "xla"
    assert "the Pallas kernel has no attention sinks" in caplog.text


def test_experts_and_sinks_shard_over_the_mesh(ckpt_dir):
    """Heads (and their sinks) and experts over model=2, rows over data=4: the same
    hooks as one device."""
    from actx.workers.model import sharding

    path = ckpt_dir("gpt_oss")
    ids = np.random.RandomState(5).randint(1, 512, (8, 16)).astype(np.int32)
    single = layout_tests._extract(path, ids)
    model = model_lib.load_pretrained(path, mesh=sharding.make_mesh(data=4, model=2))
    assert "model" in str(model.params["layers"]["sinks_ln"].sharding.spec)
    out = step.make_extract_fn(model, capture.CaptureSpec.parse(ALL_HOOKS))(ids)
    layout_tests._assert_hooks_equal({k: np.asarray(v) for k, v in out.items()}, single)


def test_every_mxfp4_byte_and_scale_dequantises_as_transformers_does():
    """All 256 bytes (both nibbles) under all 256 scales, the extremes included, in float32
    and bfloat16: transformers' `convert_moe_packed_tensors` bit for bit."""
    import ml_dtypes
    import torch
    from transformers.integrations import mxfp4 as hf_mxfp4

    blocks = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(16, 16),
                             (2, 256, 16, 16)).copy()  # [experts, rows, groups, 16]
    scales = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None], (2, 256, 16)).copy()
    scales[1] = scales[1, ::-1]
    for ours_dtype, torch_dtype in ((np.float32, torch.float32),
                                    (ml_dtypes.bfloat16, torch.bfloat16)):
        want = hf_mxfp4.convert_moe_packed_tensors(
            torch.as_tensor(blocks), torch.as_tensor(scales), dtype=torch_dtype)
        got = mxfp4.dequantize(blocks, scales, ours_dtype)
        assert got.shape == tuple(want.shape) == (2, 16 * 32, 256)
        np.testing.assert_array_equal(got.astype(np.float32), want.float().numpy())


@pytest.mark.parametrize("arch,rope", [
    # Qwen2.5's long-context recipe (rope_scaling yarn factor 4 over 32k), shrunk: the
    # context from the top of the rope parameters, truncate by default.
    ("qwen2", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
               "original_max_position_embeddings": 256}),
    ("llama3", {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.2, "mscale_all_dim": 0.8,
                "original_max_position_embeddings": 512}),
    ("qwen3_moe_mixed", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                         "attention_factor": 1.3, "original_max_position_embeddings": 128})])
def test_yarn_on_other_families_matches_hf(tmp_path, arch, rope):
    """YaRN is the rotary embedding's, not gpt-oss's: any family whose config states it
    rotates as HF does (each case moves HF's result away from the default RoPE)."""
    path = hf_models.make_tiny_checkpoint(tmp_path / "with", arch, rope_parameters=rope,
                                          rope_scaling=None)
    ids = np.random.RandomState(7).randint(1, 512, (1, 20)).astype(np.int32)
    ref = hf_models.hf_hooks(hf_models.load_hf_model(path), ids)
    hooks = ALL_HOOKS if arch in hf_models.MOE_LAYOUT_ARCHS else \
        "layers.*.resid_pre,layers.*.resid_post,layers.*.attn_out,embed,final_norm"
    ours = layout_tests._extract(path, ids, hooks=hooks)
    layout_tests._assert_hooks_equal(ours, {k: ref[k] for k in ours})
    assert _config(path).rope.rope_type == "yarn"
    default = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    without = gpt_tests._copy_with(path, tmp_path / "without", rope_parameters=default)
    other = hf_models.hf_hooks(hf_models.load_hf_model(without), ids)
    assert gpt_tests._max_rel(other["layers.1.attn_out"], ref["layers.1.attn_out"]) > 1e-3

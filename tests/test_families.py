"""Model families as data (workers.model.families), and the families added with it: Phi-3 (fused
qkv/gate_up, partial rotary, longrope) and OLMo 2 (norms after attention and the MLP,
q/k norms over the whole projection), against HF transformers run on each document."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from actx.schemas import runspec
from actx.workers.model import capture, checkpoint, checkpoint_check, families, step
from actx.workers.model import decoder as model_lib
from actx.workers.model.config import ModelConfig
from tests import hf_models
from tests import test_long_documents as long_docs

ALL_HOOKS = ("layers.*.resid_pre,layers.*.resid_mid,layers.*.resid_post,"
             "layers.*.attn_out,layers.*.mlp_out,embed,final_norm")
SEQ = 24
NEW_DENSE = ("phi3", "phi3_longrope", "olmo2")


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return hf_models.checkpoint_maker(tmp_path_factory)


def _config(path) -> ModelConfig:
    with open(os.path.join(path, "config.json")) as f:
        return families.config_from_hf(json.load(f))


def _max_rel(ours, ref) -> float:
    return float(np.max(np.abs(np.asarray(ours, np.float32) - ref)) / np.max(np.abs(ref)))


def _rel_l2(ours, ref) -> float:
    return float(np.linalg.norm(np.asarray(ours, np.float32) - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("arch", hf_models.ARCHS)
def test_family_table_names_exactly_the_decoder_tensors_hf_saves(ckpt_dir, arch):
    """The family's tensor table, the pre-flight's list and the loader agree with what
    save_pretrained wrote: every decoder tensor is read, none is invented."""
    path = ckpt_dir(arch)
    cfg = _config(path)
    reader = checkpoint.TensorReader(path)
    prefix = checkpoint.decoder_prefix(reader)
    saved = {n for n in reader._file_of if n.startswith(prefix + "layers.")
             or n in (prefix + "embed_tokens.weight", prefix + "norm.weight")}
    assert set(checkpoint_check.needed_tensors(cfg, prefix)) == saved
    params = checkpoint.load_params(reader, cfg, np.float32)
    for name, axes in checkpoint.param_logical_axes(cfg)["layers"].items():
        assert params["layers"][name].ndim == len(axes), name
        assert params["layers"][name].shape[0] == cfg.num_layers


def test_registry_and_hook_points():
    for arch in families.SUPPORTED_ARCHITECTURES:
        family = families.for_architecture(arch)
        assert arch in family.architectures and family.block and family.reads
    assert len({f.name for f in families.FAMILIES}) == len(families.FAMILIES)
    dense = families.for_architecture("Phi3ForCausalLM").hook_points()
    assert "router_logits" not in dense and "mlp_out" in dense


def test_fused_tensors_are_split_into_the_right_rows(ckpt_dir):
    """q, k, v and gate, up come from their rows of Phi-3's fused tensors."""
    path = ckpt_dir("phi3")
    cfg = _config(path)
    reader = checkpoint.TensorReader(path)
    params = checkpoint.load_params(reader, cfg, np.float32)["layers"]
    qkv = reader.read("model.layers.1.self_attn.qkv_proj.weight")
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    v_rows = qkv[(n + k) * h:]
    np.testing.assert_array_equal(np.asarray(params["v_weight_ldkh"][1]),
                                  v_rows.T.reshape(d, k, h))
    gate_up = reader.read("model.layers.1.mlp.gate_up_proj.weight")
    np.testing.assert_array_equal(np.asarray(params["up_weight_ldf"][1]),
                                  gate_up[cfg.intermediate_size:].T)


def _extract(path, ids, dtype="float32", hooks=ALL_HOOKS, **kwargs):
    model = model_lib.load_pretrained(path, dtype=dtype)
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse(hooks, dtype=dtype))
    return {k: np.asarray(v) for k, v in fn(ids, **kwargs).items()}


@pytest.mark.parametrize("arch", NEW_DENSE)
def test_segmented_rows_match_hf_on_each_document(ckpt_dir, arch):
    """Documents of 9 and 11 tokens share a row, one of 24 fills another; Phi-3's longrope
    (original context 16) takes short factors for the first two and long ones for the
    third, as HF run on each document does."""
    path = ckpt_dir(arch)
    hf = hf_models.load_hf_model(path)
    docs, ids, pos, seg = hf_models.segmented_rows(SEQ)
    ours = _extract(path, ids, positions=pos, segment_ids=seg)
    for row, start, doc in ((0, 0, docs[0]), (0, 9, docs[1]), (1, 0, docs[2])):
        ref = hf_models.hf_hooks(hf, doc[None])
        assert sorted(ref) == sorted(ours)
        for name in ref:
            got = ours[name][row, start:start + len(doc)]
            assert _max_rel(got, ref[name][0]) <= 1e-5, (name, row, start)


@pytest.mark.parametrize("arch", ["phi3", "olmo2"])
def test_bfloat16_parity(ckpt_dir, arch):
    """Within 2e-2 relative L2 of HF in float32, or no further than HF's own bfloat16."""
    import torch

    path = ckpt_dir(arch)
    ids = np.random.RandomState(1).randint(1, 512, (2, SEQ)).astype(np.int32)
    hf = hf_models.load_hf_model(path)
    ref = hf_models.hf_hooks(hf, ids)
    hf_bf16 = hf_models.hf_hooks(hf.to(torch.bfloat16), ids)
    ours = _extract(path, ids, dtype="bfloat16")
    for name in ref:
        assert str(ours[name].dtype) == "bfloat16"
        err = _rel_l2(ours[name], ref[name])
        assert err <= max(2e-2, _rel_l2(hf_bf16[name], ref[name])), (name, err)


@pytest.mark.parametrize("arch,overrides,max_context", [
    ("phi3", {"sliding_window": 12}, 24), ("olmo2", {}, 20)])
def test_long_documents_through_the_cache_match_hf(tmp_path, arch, overrides, max_context):
    """Documents of up to 12 rows, through the worker's chain schedule and the KV cache,
    equal HF on each whole document (Phi-3 with a window of 12 on every layer)."""
    path = hf_models.make_tiny_checkpoint(tmp_path / arch, arch, **overrides)
    hf = hf_models.load_hf_model(path)
    model = model_lib.load_pretrained(path, dtype="float32")
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse(long_docs.HOOKS),
                              max_context=max_context)
    docs = long_docs._documents(0, max_context)
    block = long_docs._packed(docs, runspec.PackingSpec("segmented", long_docs.SEQ_LEN,
                                                        max_context=max_context))
    stored = long_docs.run_rows(fn, block, local_batch=3)
    long_docs.assert_documents_match_hf(stored, block, docs, hf, max_context, rtol=1e-5)


def test_longrope_refuses_the_cache(ckpt_dir):
    """A document's length picks longrope's factors; rows through the cache cannot know
    it, so such a step is refused rather than computed with the wrong factors."""
    model = model_lib.load_pretrained(ckpt_dir("phi3_longrope"))
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse("layers.0.resid_post"),
                              max_context=16)
    with pytest.raises(ValueError, match=r"longrope.*original_max_position_embeddings=16"):
        fn(np.ones((1, 8), np.int32))
    # A worker refuses it at admission, before its first step.
    import jax

    from actx.workers.loop import admission

    with pytest.raises(ValueError, match=r"max_context=16: Phi3ForCausalLM's longrope"):
        admission.check_context_fits(jax, None, model, fn, None, 1, 1, 8, 16)
    # And the pre-flight names the key before any work (actx submit's exit 2).
    from actx.workers import preflight

    def spec(**packing):
        return runspec.RunSpec.from_dict({
            "model": {"path": ckpt_dir("phi3_longrope")}, "tokenizer": {"path": "unused"},
            "sources": [{"kind": "text", "paths": ["none.jsonl"]}],
            "packing": {"mode": "segmented", "seq_len": 8, **packing},
            "capture": {"hooks": "layers.0.resid_post"}})

    problems = preflight.check_job(spec(max_context=16), batch_size=1).problems
    assert any(p.startswith("spec.packing.max_context=16: Phi3ForCausalLM's longrope")
               and "packing.overflow: truncate" in p for p in problems), problems
    alone = preflight.check_job(spec(overflow="truncate"), batch_size=1).problems
    assert not any("longrope" in p for p in alone), alone
    # What the refusal advises passes: pad carries context too, so it names no pad
    # (it said "or packing.mode: pad", which the same check refused).
    padded = preflight.check_job(spec(mode="pad"), batch_size=1).problems
    assert any("longrope" in p for p in padded), padded
    assert not any("packing.mode: pad" in p for p in problems), problems
    for mode in ("pad", "segmented"):
        advised = preflight.check_job(spec(mode=mode, overflow="truncate"), batch_size=1)
        assert not any("longrope" in p for p in advised.problems), advised.problems


def _copy_with(path, tmp_path, **fields) -> str:
    dest = tmp_path / "ckpt"
    shutil.copytree(path, dest)
    with open(dest / "config.json") as f:
        config = json.load(f)
    config.update(fields)
    with open(dest / "config.json", "w") as f:
        json.dump(config, f)
    return str(dest)


@pytest.mark.parametrize("arch,fields,pattern", [
    ("phi3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                  "rope_theta": 1e4}},
     r"rope_parameters\.rope_type='dynamic'.*longrope"),
    ("phi3", {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ("olmo2", {"attention_bias": True}, r"attention_bias=True"),
    # Dense layers between sparse ones are read (tests/test_moe_layouts.py); a layout
    # that names no layer rule is not.
    ("qwen3_moe", {"decoder_sparse_step": 0}, r"decoder_sparse_step=0.*>= 1"),
    ("olmoe", {"clip_qkv": 8.0}, r"clip_qkv=8\.0"),
    ("mixtral", {"num_experts_per_tok": 9}, r"num_experts_per_tok=9"),
])
def test_unsupported_options_are_named(ckpt_dir, tmp_path, arch, fields, pattern):
    path = _copy_with(ckpt_dir(arch), tmp_path, **fields)
    with pytest.raises(ValueError, match=pattern):
        model_lib.load_pretrained(path)


def test_phi3_rope_settings_from_older_configs():
    """4.x Phi-3 configs: rope_scaling type "su" is longrope, the factor comes from the
    two context lengths, and partial_rotary_factor sits at the top level."""
    hf = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 512,
          "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
          "partial_rotary_factor": 0.75, "rope_theta": 10000.0,
          "rope_scaling": {"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}}
    rope = families.config_from_hf(hf).rope
    assert rope.rope_type == "longrope" and rope.rotary_dim(16) == 12
    assert rope.factor == 32.0
    assert rope.attention_factor == pytest.approx(np.sqrt(1 + np.log(32) / np.log(4096)))

"""Mixture layouts beyond one mixture on every layer: Qwen3-MoE with dense layers between
sparse ones (mlp_only_layers, decoder_sparse_step) and Qwen2-MoE (a shared expert behind a
sigmoid gate, q/k/v biases, its own sliding-window layer rule). Every hook of every token
equals HF transformers, in float32 and bfloat16, documents alone, in segmented rows and
through the KV carry; the router's points exist on the sparse layers only (a dense
layer's index is refused by name); every setting read is shown to move HF's result."""

from __future__ import annotations

import dataclasses
import json
import re
import os

import numpy as np
import pytest

from actx.schemas import runspec
from actx.workers.model import capture, checkpoint, checkpoint_check, families, step
from actx.workers.model import decoder as model_lib
from tests import hf_models
from tests import test_families_gpt as gpt_tests
from tests import test_long_documents as long_docs

SEQ = 24
ROUTER = "layers.*.router_logits,layers.*.experts"
ALL_HOOKS = ("layers.*.resid_pre,layers.*.resid_mid,layers.*.resid_post,"
             "layers.*.attn_out,layers.*.mlp_out,embed,final_norm," + ROUTER)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return hf_models.checkpoint_maker(tmp_path_factory)


def _config(path):
    return hf_models.actx_config(path)


def _extract(path, ids, dtype="float32", hooks=ALL_HOOKS, **kwargs):
    model = model_lib.load_pretrained(path, dtype=dtype)
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse(hooks, dtype=dtype))
    return {k: np.asarray(v) for k, v in fn(ids, **kwargs).items()}


def _assert_hooks_equal(ours, ref, context=""):
    """The same hooks (router points only where HF has a router); floats within 1e-5 of
    the largest magnitude; expert ids identical."""
    assert sorted(ours) == sorted(ref), context
    for name, want in ref.items():
        got = ours[name]
        if name.endswith("expert_ids"):
            np.testing.assert_array_equal(got, want, err_msg=f"{name} {context}")
        else:
            assert gpt_tests._max_rel(got, want) <= 1e-5, (name, context)


def test_the_layouts_sparse_and_dense_layers_are_hfs(ckpt_dir):
    """Which layers route is HF's rule: not in mlp_only_layers and (i + 1) a multiple of
    decoder_sparse_step."""
    import torch

    for arch in hf_models.MOE_LAYOUT_ARCHS:
        path = ckpt_dir(arch)
        hf = hf_models.load_hf_model(path)
        routed = tuple(i for i, layer in enumerate(hf.model.layers)
                       if hasattr(layer.mlp, "experts"))
        assert _config(path).router_layers == routed
        assert 0 < len(routed) < len(hf.model.layers)
        assert isinstance(hf.model.layers[0].mlp, torch.nn.Module)


@pytest.mark.parametrize("arch", hf_models.MOE_LAYOUT_ARCHS)
def test_family_table_names_exactly_the_decoder_tensors_hf_saves(ckpt_dir, arch):
    path = ckpt_dir(arch)
    cfg = _config(path)
    reader = checkpoint.TensorReader(path)
    saved = {n for n in reader._file_of if n.startswith("model.")}
    assert set(checkpoint_check.needed_tensors(cfg, "model.")) == saved
    params = checkpoint.load_params(reader, cfg, np.float32)["layers"]
    # A dense layer holds zeros where the experts would be, and the reverse.
    dense = [i for i in range(cfg.num_layers) if i not in cfg.router_layers]
    assert not np.any(np.asarray(params["expert_up_ledf"][dense[0]]))
    assert not np.any(np.asarray(params["up_weight_ldf"][cfg.router_layers[0]]))
    assert np.all(np.asarray(params["up_weight_ldf"][dense[0]]).T == reader.read(
        f"model.layers.{dense[0]}.mlp.up_proj.weight"))


@pytest.mark.parametrize("arch,impl", [(a, "blocked") for a in hf_models.MOE_LAYOUT_ARCHS]
                         + [("qwen2_moe", "ragged"), ("qwen2_moe", "dense")])
def test_every_hook_matches_hf_on_each_document(ckpt_dir, monkeypatch, arch, impl):
    """Segmented rows (two documents in a row, padding, an all-padding row): every hook,
    the router's on its sparse layers (ids exactly)."""
    monkeypatch.setattr(model_lib, "EXPERT_MATMULS", impl)
    path = ckpt_dir(arch)
    hf = hf_models.load_hf_model(path)
    docs, ids, pos, seg = hf_models.segmented_rows(SEQ)
    ours = _extract(path, ids, positions=pos, segment_ids=seg)
    for row, start, doc in ((0, 0, docs[0]), (0, 9, docs[1]), (1, 0, docs[2])):
        ref = hf_models.hf_hooks(hf, doc[None])
        got = {k: v[row, start:start + len(doc)][None] for k, v in ours.items()}
        _assert_hooks_equal(got, ref, f"row {row} start {start}")


@pytest.mark.parametrize("arch", hf_models.MOE_LAYOUT_ARCHS)
def test_bfloat16_parity(ckpt_dir, arch):
    """Within 2e-2 relative L2 of HF in float32, or no further than HF's own bfloat16.
    bfloat16 may move a near tie of the router (HF's own bfloat16 does, on other tokens):
    at most 1 token in 10 may choose otherwise than float32 does, and a sparse layer's
    mlp_out and weights are compared on the tokens whose choice is float32's."""
    import torch

    path = ckpt_dir(arch)
    ids = np.random.RandomState(1).randint(1, 512, (2, SEQ)).astype(np.int32)
    hf = hf_models.load_hf_model(path)
    ref = hf_models.hf_hooks(hf, ids)
    hf_bf16 = hf_models.hf_hooks(hf.to(torch.bfloat16), ids)
    ours = _extract(path, ids, dtype="bfloat16")
    assert sorted(ours) == sorted(ref)
    same = {}
    for name in ref:
        if name.endswith("expert_ids"):
            layer = name.rsplit(".", 1)[0]
            same[layer] = np.all(ours[name] == ref[name], axis=-1)
            assert np.mean(same[layer]) >= 0.9, (name, np.mean(same[layer]))
    for name in ref:
        if name.endswith("expert_ids"):
            continue
        layer = name.rsplit(".", 1)[0]
        got, want, theirs = ours[name], ref[name], hf_bf16[name]
        if layer in same and name.endswith(("mlp_out", "expert_weights")):
            got, want, theirs = got[same[layer]], want[same[layer]], theirs[same[layer]]
        err = gpt_tests._rel_l2(got, want)
        assert err <= max(2e-2, gpt_tests._rel_l2(theirs, want)), (name, err)


@pytest.mark.parametrize("arch,overrides", [
    ("qwen2_moe", {}),
    # Window 6 on layer 0 only (even layers below max_window_layers), shorter than
    # max_context and than most documents.
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2}),
    ("qwen3_moe_mixed", {"use_sliding_window": True, "sliding_window": 6})])
def test_long_documents_through_the_cache_match_hf(tmp_path, arch, overrides):
    """Documents of up to 12 rows through the chain schedule and the KV cache: every
    hook, the router's too, equals HF on each whole document."""
    max_context = 24
    path = hf_models.make_tiny_checkpoint(tmp_path / arch, arch, **overrides)
    hf = hf_models.load_hf_model(path)
    model = model_lib.load_pretrained(path)
    fn = step.make_extract_fn(
        model, capture.CaptureSpec.parse(long_docs.HOOKS + "," + ROUTER),
        max_context=max_context)
    docs = long_docs._documents(0, max_context)
    block = long_docs._packed(docs, runspec.PackingSpec("segmented", long_docs.SEQ_LEN,
                                                        max_context=max_context))
    stored = long_docs.run_rows(fn, block, local_batch=3)
    assert {n.split(".")[1] for n in stored if "expert" in n} == {
        str(i) for i in model.config.router_layers}
    long_docs.assert_documents_match_hf(stored, block, docs, hf, max_context, rtol=1e-5)


def _zeroed_shared_gate(path, dest) -> str:
    """The checkpoint with its shared expert gates at zero (sigmoid 0.5 everywhere)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(path, dest)
    file = os.path.join(dest, "model.safetensors")
    tensors = load_file(file)
    for name in tensors:
        if name.endswith("shared_expert_gate.weight"):
            tensors[name] = np.zeros_like(tensors[name])
    save_file(tensors, file, metadata={"format": "pt"})
    return str(dest)


# (arch, the setting, the base config's value where the weights do not depend on it).
SETTINGS = [
    ("qwen2_moe", {"norm_topk_prob": True}, {"norm_topk_prob": False}),
    ("qwen2_moe", {"qkv_bias": False}, None),
    ("qwen2_moe", {"mlp_only_layers": [], "decoder_sparse_step": 2}, None),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2},
     {"use_sliding_window": False}),
    # Window on layers 0 and 2 (layer_types as written by transformers 5).
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 3},
     {"layer_types": ["full_attention"] * 3}),
    ("qwen3_moe_mixed", {"mlp_only_layers": []}, None),
    ("qwen3_moe_mixed", {"decoder_sparse_step": 1, "mlp_only_layers": [0, 2]}, None),
    # No sparse layer left: every MLP dense (and no router points).
    ("qwen3_moe_mixed", {"decoder_sparse_step": 5}, None),
    ("qwen3_moe_mixed", {"use_sliding_window": True, "sliding_window": 5},
     {"use_sliding_window": False}),
    ("qwen3_moe_mixed", {"norm_topk_prob": False}, {"norm_topk_prob": True}),
    # The experts', the shared expert's and the dense layers' activation.
    ("qwen2_moe", {"hidden_act": "gelu"}, {"hidden_act": "silu"}),
    ("qwen3_moe_mixed", {"hidden_act": "gelu_pytorch_tanh"}, {"hidden_act": "silu"}),
]


@pytest.mark.parametrize("arch,setting,base", SETTINGS)
def test_every_setting_read_moves_the_result(tmp_path, arch, setting, base):
    """With the setting, ours equals HF; HF with the same weights and the setting at its
    base value differs by far more than that tolerance (settings that change which
    tensors a layer has are read by the load: ignoring them finds other tensors)."""
    path = hf_models.make_tiny_checkpoint(tmp_path / "with", arch, **setting)
    ids = np.random.RandomState(2).randint(1, 512, (1, 20)).astype(np.int32)
    hf = hf_models.load_hf_model(path)
    ref = hf_models.hf_hooks(hf, ids)
    routed = _config(path).router_layers  # none: no router points to ask for
    ours = _extract(path, ids, hooks=ALL_HOOKS if routed else ALL_HOOKS.replace(
        "," + ROUTER, ""))
    _assert_hooks_equal(ours, ref, str(setting))
    if base is None:
        return
    without = gpt_tests._copy_with(path, tmp_path / "without", **base)
    if "use_sliding_window" in base:
        without = gpt_tests._copy_with(without, tmp_path / "without2", layer_types=None)
    other = hf_models.hf_hooks(hf_models.load_hf_model(without), ids)
    moved = max(gpt_tests._max_rel(other[name], ref[name]) for name in ref
                if name != "embed" and not name.endswith("expert_ids"))
    assert moved > 1e-4, (setting, moved)


def test_the_shared_expert_and_its_gate_are_in_mlp_out(ckpt_dir, tmp_path):
    """mlp_out is the routed sum plus sigmoid(gate) times the shared expert: with the
    gates zeroed (sigmoid 0.5) HF's mlp_out moves, and ours follows it."""
    path = ckpt_dir("qwen2_moe")
    ids = np.random.RandomState(5).randint(1, 512, (1, 20)).astype(np.int32)
    ref = hf_models.hf_hooks(hf_models.load_hf_model(path), ids)
    zeroed = _zeroed_shared_gate(path, tmp_path / "zeroed")
    ref0 = hf_models.hf_hooks(hf_models.load_hf_model(zeroed), ids)
    assert gpt_tests._max_rel(ref0["layers.0.mlp_out"], ref["layers.0.mlp_out"]) > 1e-2
    ours0 = _extract(zeroed, ids)
    _assert_hooks_equal(ours0, ref0)
    # The router's choice is the routed experts' alone: the gate does not move it.
    np.testing.assert_array_equal(ours0["layers.0.expert_ids"], ref["layers.0.expert_ids"])


def test_router_points_name_the_sparse_layers(ckpt_dir):
    """layers.*.experts takes the sparse layers; a dense layer's index is refused by name
    with the layers that have a router."""
    cfg = _config(ckpt_dir("qwen3_moe_mixed"))
    assert cfg.router_layers == (1,)
    spec = capture.CaptureSpec.parse("layers.*.experts,layers.*.resid_post")
    spec.validate(cfg)
    assert spec.hook_names(cfg.num_layers, capture.router_layers_of(cfg)) == sorted(
        [f"layers.{i}.resid_post" for i in range(4)]
        + ["layers.1.expert_ids", "layers.1.expert_weights"])
    for hook in ("layers.2.router_logits", "layers.0-1.experts"):
        with pytest.raises(ValueError, match=r"have a dense MLP .*sparse layers: 1"):
            capture.CaptureSpec.parse(hook).validate(cfg)
    all_dense = dataclasses.replace(cfg, moe_layers=(False,) * 4)
    capture.CaptureSpec.parse("layers.*.resid_post").validate(all_dense)
    with pytest.raises(ValueError, match=r"every layer of Qwen3MoeForCausalLM has a dense"):
        capture.CaptureSpec.parse("layers.*.experts,layers.*.resid_post").validate(all_dense)


@pytest.mark.parametrize("field,value", [("mlp_only_layers", [7]),
                                         ("mlp_only_layers", "1"),
                                         ("decoder_sparse_step", 0)])
def test_bad_layouts_are_refused_by_name(ckpt_dir, field, value):
    with open(os.path.join(ckpt_dir("qwen3_moe_mixed"), "config.json")) as f:
        hf = json.load(f)
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}")):
        families.config_from_hf({**hf, field: value})


@pytest.mark.parametrize("arch", hf_models.MOE_LAYOUT_ARCHS)
def test_dense_sparse_and_shared_layers_shard_over_the_mesh(ckpt_dir, arch):
    """Experts over model=4 (expert parallelism), the dense MLPs and the shared expert
    over their width, rows over data=2: the same hooks as one device."""
    from actx.workers.model import sharding

    path = ckpt_dir(arch)
    ids = np.random.RandomState(5).randint(1, 512, (8, 16)).astype(np.int32)
    single = _extract(path, ids)
    model = model_lib.load_pretrained(path, mesh=sharding.make_mesh(data=2, model=4))
    out = step.make_extract_fn(model, capture.CaptureSpec.parse(ALL_HOOKS))(ids)
    _assert_hooks_equal({k: np.asarray(v) for k, v in out.items()}, single)


@pytest.mark.parametrize("arch", hf_models.MOE_LAYOUT_ARCHS)
def test_the_step_cost_counts_each_layers_own_mlp(ckpt_dir, arch):
    """The workers' step cost (admission) counts a dense layer's MLP on the dense layers
    and the experts (and a shared expert) on the sparse ones: its FLOPs are the dry run's
    bound per token (which tests/test_cost_bound.py holds to HF's parameters) times the
    tokens; the weights a step reads grow with the experts reached on the sparse layers
    only."""
    from actx.deploy import cost_bound
    from actx.workers.loop import admission

    cfg = _config(ckpt_dir(arch))
    for layers in range(1, cfg.num_layers + 1):
        assert admission.step_cost(cfg, 100, layers).flops == pytest.approx(
            100 * cost_bound.forward_flops_per_token(cfg, layers, 0), rel=1e-12)
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    grew = admission.step_cost(cfg, 2).weight_bytes - admission.step_cost(cfg, 1).weight_bytes
    sparse = len(cfg.router_layers)
    assert grew == sparse * cfg.experts_per_token * expert_bytes + cfg.hidden_size * 2

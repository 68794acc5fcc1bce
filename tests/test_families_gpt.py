"""GPT-2 and GPT-NeoX (Pythia) against HF transformers run on each document alone: every
hook of every token, in float32 and bfloat16, documents alone, in segmented rows and
(GPT-NeoX, and GPT-2 within its n_positions) through the KV cache; every config setting
they read is shown to move HF's result, so a decoder that ignored it would fail; what is
not supported is refused by name."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from actx.schemas import runspec
from actx.workers.model import capture, checkpoint, checkpoint_check, families, step
from actx.workers.model import decoder as model_lib
from tests import hf_models
from tests import test_long_documents as long_docs

SEQ = 24
PARALLEL_HOOKS = ("layers.*.resid_pre,layers.*.resid_post,layers.*.attn_out,"
                  "layers.*.mlp_out,embed,final_norm")
ALL_HOOKS = PARALLEL_HOOKS + ",layers.*.resid_mid"
# (arch, config overrides): Pythia's parallel block and the sequential one.
MODELS = [("gpt2", {}), ("gpt_neox", {}), ("gpt_neox", {"use_parallel_residual": False})]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return hf_models.checkpoint_maker(tmp_path_factory)


def _config(path):
    return hf_models.actx_config(path)


def _hooks(path) -> str:
    return PARALLEL_HOOKS if _config(path).parallel_residual else ALL_HOOKS


def _extract(path, ids, dtype="float32", **kwargs):
    model = model_lib.load_pretrained(path, dtype=dtype)
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse(_hooks(path), dtype=dtype))
    return {k: np.asarray(v) for k, v in fn(ids, **kwargs).items()}


def _max_rel(ours, ref) -> float:
    return float(np.max(np.abs(np.asarray(ours, np.float32) - ref)) / np.max(np.abs(ref)))


def _rel_l2(ours, ref) -> float:
    return float(np.linalg.norm(np.asarray(ours, np.float32) - ref) / np.linalg.norm(ref))


def _copy_with(path, dest, **fields) -> str:
    shutil.copytree(path, dest)
    with open(os.path.join(dest, "config.json")) as f:
        config = json.load(f)
    config.update(fields)
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dest)


@pytest.mark.parametrize("arch", hf_models.GPT_ARCHS)
def test_family_table_names_exactly_the_decoder_tensors_hf_saves(ckpt_dir, arch):
    path = ckpt_dir(arch)
    cfg = _config(path)
    reader = checkpoint.TensorReader(path)
    prefix = checkpoint.decoder_prefix(reader, cfg=cfg)
    assert prefix == {"gpt2": "transformer.", "gpt_neox": "gpt_neox."}[arch]
    saved = {n for n in reader._file_of if n.startswith(prefix)}
    assert set(checkpoint_check.needed_tensors(cfg, prefix)) == saved
    params = checkpoint.load_params(reader, cfg, np.float32)
    axes = checkpoint.param_logical_axes(cfg)
    assert set(axes) - {"layers"} == set(params) - {"layers"}
    for name, names in axes["layers"].items():
        assert params["layers"][name].ndim == len(names), name


def test_checkpoints_saved_without_the_head_prefix_are_read(ckpt_dir, tmp_path):
    """openai-community/gpt2 keeps its tensors without `transformer.` (saved as
    GPT2Model): the same weights read either way."""
    from safetensors.numpy import load_file, save_file

    path = ckpt_dir("gpt2")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(path, "config.json"), bare / "config.json")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()},
              str(bare / "model.safetensors"))
    ids = np.random.RandomState(3).randint(1, 512, (1, 16)).astype(np.int32)
    want, got = _extract(path, ids), _extract(str(bare), ids)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_fused_tensors_are_split_in_their_own_layouts(ckpt_dir):
    """GPT-NeoX's query_key_value is [head, (q, k, v), head_dim] along its output;
    GPT-2's c_attn is Conv1D [in, out] with q, k, v as column blocks."""
    path = ckpt_dir("gpt_neox")
    cfg = _config(path)
    reader = checkpoint.TensorReader(path)
    params = checkpoint.load_params(reader, cfg, np.float32)["layers"]
    qkv = reader.read("gpt_neox.layers.1.attention.query_key_value.weight")
    h = cfg.head_dim
    for head in range(cfg.num_heads):
        k_rows = qkv[head * 3 * h + h: head * 3 * h + 2 * h]  # [h, d]
        np.testing.assert_array_equal(np.asarray(params["k_weight_ldkh"][1][:, head]),
                                      k_rows.T)
    path = ckpt_dir("gpt2")
    cfg = _config(path)
    reader = checkpoint.TensorReader(path)
    params = checkpoint.load_params(reader, cfg, np.float32)["layers"]
    c_attn = reader.read("transformer.h.2.attn.c_attn.weight")
    d = cfg.hidden_size
    np.testing.assert_array_equal(np.asarray(params["v_weight_ldkh"][2]).reshape(d, d),
                                  c_attn[:, 2 * d:])


@pytest.mark.parametrize("arch,overrides", MODELS)
def test_each_document_alone_and_in_segmented_rows_match_hf(ckpt_dir, arch, overrides):
    """Every hook of every token: documents of 9 and 11 tokens share a row, one of 24
    fills another, each equal to HF on the document alone (GPT-2's learned positions
    restart at each document, as the rotary families' do)."""
    path = ckpt_dir(arch, **overrides)
    hf = hf_models.load_hf_model(path)
    docs, ids, pos, seg = hf_models.segmented_rows(SEQ)
    ours = _extract(path, ids, positions=pos, segment_ids=seg)
    for row, start, doc in ((0, 0, docs[0]), (0, 9, docs[1]), (1, 0, docs[2])):
        ref = hf_models.hf_hooks(hf, doc[None])
        assert sorted(ref) == sorted(ours)
        for name in ref:
            got = ours[name][row, start:start + len(doc)]
            assert _max_rel(got, ref[name][0]) <= 1e-5, (name, row, start)


@pytest.mark.parametrize("arch,overrides", MODELS)
def test_bfloat16_parity(ckpt_dir, arch, overrides):
    """Within 2e-2 relative L2 of HF in float32, or no further than HF's own bfloat16."""
    import torch

    path = ckpt_dir(arch, **overrides)
    ids = np.random.RandomState(1).randint(1, 512, (2, SEQ)).astype(np.int32)
    hf = hf_models.load_hf_model(path)
    ref = hf_models.hf_hooks(hf, ids)
    hf_bf16 = hf_models.hf_hooks(hf.to(torch.bfloat16), ids)
    ours = _extract(path, ids, dtype="bfloat16")
    assert sorted(ours) == sorted(ref)
    for name in ref:
        assert str(ours[name].dtype) == "bfloat16"
        err = _rel_l2(ours[name], ref[name])
        assert err <= max(2e-2, _rel_l2(hf_bf16[name], ref[name])), (name, err)


@pytest.mark.parametrize("arch,overrides,max_context", [
    ("gpt_neox", {}, 24), ("gpt_neox", {"use_parallel_residual": False}, 20),
    # Within n_positions=128 every document (at most 90 tokens) has its positions.
    ("gpt2", {"n_positions": 128}, 24)])
def test_long_documents_through_the_cache_match_hf(tmp_path, arch, overrides, max_context):
    """Documents of up to 12 rows, through the worker's chain schedule and the KV cache,
    equal HF on each whole document (band masks past max_context)."""
    path = hf_models.make_tiny_checkpoint(tmp_path / arch, arch, **overrides)
    hf = hf_models.load_hf_model(path)
    model = model_lib.load_pretrained(path, dtype="float32")
    hooks = _hooks(path)
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse(hooks),
                              max_context=max_context)
    docs = long_docs._documents(0, max_context)
    block = long_docs._packed(docs, runspec.PackingSpec("segmented", long_docs.SEQ_LEN,
                                                        max_context=max_context))
    stored = long_docs.run_rows(fn, block, local_batch=3)
    long_docs.assert_documents_match_hf(stored, block, docs, hf, max_context, rtol=1e-5)


# (arch, the setting, the base config's value where the weights do not depend on it).
SETTINGS = [
    ("gpt2", {"layer_norm_epsilon": 0.5}, {"layer_norm_epsilon": 1e-5}),
    # gelu and its tanh approximation differ by < 1e-3 where |x| < 3: larger weights
    # (initializer_range) bring the MLP's inputs where they part.
    ("gpt2", {"activation_function": "gelu", "initializer_range": 0.3},
     {"activation_function": "gelu_new"}),
    ("gpt2", {"activation_function": "silu"}, {"activation_function": "gelu_new"}),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True},
     {"scale_attn_by_inverse_layer_idx": False}),
    ("gpt2", {"scale_attn_weights": False}, {"scale_attn_weights": True}),
    ("gpt2", {"n_inner": 96}, None),
    ("gpt_neox", {"use_parallel_residual": False}, {"use_parallel_residual": True}),
    ("gpt_neox", {"rotary_pct": 1.0}, {"rotary_pct": 0.25}),
    ("gpt_neox", {"rotary_pct": 0.5}, {"rotary_pct": 0.25}),
    ("gpt_neox", {"rotary_emb_base": 100}, {"rotary_emb_base": 10000}),
    ("gpt_neox", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
     {"rope_type": "default"}),
    ("gpt_neox", {"layer_norm_eps": 0.5}, {"layer_norm_eps": 1e-5}),
    ("gpt_neox", {"hidden_act": "gelu_new", "initializer_range": 0.3},
     {"hidden_act": "gelu"}),
    ("gpt_neox", {"attention_bias": False}, None),
]


@pytest.mark.parametrize("arch,setting,base", SETTINGS)
def test_every_setting_read_moves_the_result(tmp_path, arch, setting, base):
    """With the setting, ours equals HF; HF with the same weights and the setting at its
    base value differs by far more than that tolerance, so a decoder that ignored the
    setting would fail (settings that change the weights' shapes are read by the load)."""
    path = hf_models.make_tiny_checkpoint(tmp_path / "with", arch, **setting)
    ids = np.random.RandomState(2).randint(1, 512, (1, 20)).astype(np.int32)
    ref = hf_models.hf_hooks(hf_models.load_hf_model(path), ids)
    ours = _extract(path, ids)
    for name in ours:
        assert _max_rel(ours[name], ref[name]) <= 1e-5, name
    if base is None:
        return
    hf_config = hf_models.load_hf_model(path).config.to_dict()
    without = _copy_with(path, tmp_path / "without", **base)
    rope_keys = {"rotary_pct": "partial_rotary_factor", "rotary_emb_base": "rope_theta",
                 "rope_type": "rope_type"}
    if arch == "gpt_neox" and set(rope_keys) & set(base):
        # transformers 5 writes these into rope_parameters: change them there.
        rope = dict(hf_config["rope_parameters"])
        rope.update({rope_keys[k]: v for k, v in base.items()})
        if rope["rope_type"] == "default":
            rope.pop("factor", None)
        without = _copy_with(path, tmp_path / "without2", rope_parameters=rope)
    other = hf_models.hf_hooks(hf_models.load_hf_model(without), ids)
    moved = max(_max_rel(other[name], ref[name]) for name in ref
                if name != "embed" and name in other)
    assert moved > 1e-4, (setting, moved)  # ten times the tolerance and more


def test_reorder_and_upcast_attn_is_what_actx_always_does(ckpt_dir, tmp_path):
    """The flag asks for float32 logits and softmax, which actx's attention computes
    whatever it says: read, and equal to HF with it."""
    path = _copy_with(ckpt_dir("gpt2"), tmp_path / "upcast", reorder_and_upcast_attn=True)
    ids = np.random.RandomState(4).randint(1, 512, (1, 20)).astype(np.int32)
    ref = hf_models.hf_hooks(hf_models.load_hf_model(path), ids)
    ours = _extract(path, ids)
    for name in ours:
        assert _max_rel(ours[name], ref[name]) <= 1e-5, name


def test_a_parallel_block_has_no_resid_mid(ckpt_dir):
    """Pythia's blocks add attention and the MLP to their input together: resid_mid is
    refused by name, with the reason; the sequential form has it."""
    cfg = _config(ckpt_dir("gpt_neox"))
    assert "resid_mid" not in families.layer_points(cfg)
    with pytest.raises(ValueError, match=r"hook point resid_mid: GPTNeoXForCausalLM has no "
                                         r"such point: a parallel block"):
        capture.CaptureSpec.parse("layers.0.resid_mid,layers.0.resid_post").validate(cfg)
    capture.CaptureSpec.parse("layers.0.resid_mid").validate(
        _config(ckpt_dir("gpt_neox", use_parallel_residual=False)))


@pytest.mark.parametrize("arch,fields,pattern", [
    ("gpt2", {"activation_function": "gelu_fast"}, r"activation_function='gelu_fast'"),
    ("gpt2", {"add_cross_attention": True}, r"add_cross_attention=True"),
    ("gpt_neox", {"hidden_act": "relu"}, r"hidden_act='relu'"),
    ("gpt_neox", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                      "rope_theta": 1e4}}, r"rope_type='dynamic'"),
])
def test_unsupported_options_are_named(ckpt_dir, tmp_path, arch, fields, pattern):
    path = _copy_with(ckpt_dir(arch), tmp_path / "ckpt", **fields)
    with pytest.raises(ValueError, match=pattern):
        model_lib.load_pretrained(path)


def test_positions_past_n_positions_are_refused(ckpt_dir):
    """GPT-2's learned positions end at n_positions (64 here): a step never looks past
    them (a lookup would clamp silently), and the pre-flight refuses a run whose rows
    or continued documents could reach them, naming the setting and what to set."""
    path = ckpt_dir("gpt2")
    model = model_lib.load_pretrained(path)
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse("layers.0.resid_post"))
    fn(np.ones((1, 64), np.int32))
    with pytest.raises(ValueError, match=r"position 64: GPT2LMHeadModel's learned position "
                                         r"embeddings end at n_positions=64"):
        fn(np.ones((1, 65), np.int32))
    with pytest.raises(ValueError, match=r"position 70"):
        fn(np.ones((1, 8), np.int32), positions=np.arange(63, 71)[None])
    from actx.workers import preflight

    def spec(**packing):
        return runspec.RunSpec.from_dict({
            "model": {"path": path}, "tokenizer": {"path": "unused"},
            "sources": [{"kind": "text", "paths": ["none.jsonl"]}],
            "packing": {"mode": "segmented", **packing},
            "capture": {"hooks": "layers.0.resid_post"}})

    problems = preflight.check_job(spec(seq_len=128, overflow="truncate"),
                                   batch_size=1).problems
    assert any(p.startswith("spec.packing.seq_len=128: GPT2LMHeadModel's learned position "
                            "embeddings end at n_positions=64") and
               p.endswith("set packing.seq_len to at most 64") for p in problems), problems
    problems = preflight.check_job(spec(seq_len=32), batch_size=1).problems
    assert any(p.startswith("spec.packing.overflow='continue'") and
               "set packing.overflow: truncate" in p for p in problems), problems
    assert not any("max_context" in p for p in problems), problems
    fine = preflight.check_job(spec(seq_len=64, overflow="truncate"), batch_size=1).problems
    assert not any("position" in p for p in fine), fine
    # A generating run continues documents (truncate would cut answers) but bounds every
    # position by max_context (a prompt with its answer fits it, a longer prompt is
    # rejected at prepare): max_context is what must fit the table.

    def generating(**packing):
        return runspec.RunSpec.from_dict({**spec(**packing).to_dict(),
                                          "generate": {"max_new_tokens": 8}})

    fits = preflight.check_job(generating(seq_len=32, max_context=64), batch_size=1).problems
    assert not any("position" in p for p in fits), fits
    problems = preflight.check_job(generating(seq_len=32, max_context=128),
                                   batch_size=1).problems
    assert any(p.startswith("spec.packing.max_context=128: GPT2LMHeadModel's learned "
                            "position embeddings end at n_positions=64") and
               p.endswith("set packing.max_context to at most 64") for p in problems), problems


@pytest.mark.parametrize("arch", hf_models.GPT_ARCHS)
def test_generation_equals_hf_greedy(ckpt_dir, arch):
    """Generation (workers.generate) embeds each token at its position (GPT-2's learned
    positions), norms with the family's LayerNorm and reads GPT-NeoX's untied embed_out:
    greedy ids equal HF generate's, and every activation HF's forward over the text."""
    from actx.workers.generate import config as generate_config
    from tests import test_generate as gen

    path = ckpt_dir(arch)
    hf = hf_models.load_hf_model(path)
    prompts = gen._prompts()
    config = generate_config.GenerateConfig(max_new_tokens=gen.MAX_NEW)
    samples = gen._generator(path, config, gen.HOOKS).run(prompts)
    for s, prompt in zip(samples, prompts):
        np.testing.assert_array_equal(s.generated_ids,
                                      gen._hf_greedy(hf, prompt, gen.MAX_NEW, ()))
        gen._compare_activations(s, hf)

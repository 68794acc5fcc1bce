"""Mixtures of experts (Qwen3-MoE, OLMoE, Mixtral): every hook, the router's included,
equals HF transformers on each document; grouped and dense expert matmuls agree; experts
shard over the mesh; ties; a router hook on a dense model is refused before any work."""

from __future__ import annotations

import io

import numpy as np
import pytest
from jax.sharding import PartitionSpec

from actx.deploy import cli
from actx.schemas import runspec
from actx.workers.model import capture, moe, sharding, step
from actx.workers.model import decoder as model_lib
from tests import hf_models
from tests import test_long_documents as long_docs
from tests import test_preflight as preflight_tests

ROUTER = "layers.*.router_logits,layers.*.experts"
ALL_HOOKS = ("layers.*.resid_pre,layers.*.resid_mid,layers.*.resid_post,"
             "layers.*.attn_out,layers.*.mlp_out,embed,final_norm," + ROUTER)
SEQ = 24


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return hf_models.checkpoint_maker(tmp_path_factory)


def _extract(path, ids, hooks=ALL_HOOKS, mesh=None, **kwargs):
    model = model_lib.load_pretrained(path, mesh=mesh)
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse(hooks))
    return {k: np.asarray(v) for k, v in fn(ids, **kwargs).items()}


def _assert_hooks_equal(ours, ref, context=""):
    """Floats within 1e-5 of the largest magnitude; expert ids identical."""
    assert sorted(ours) == sorted(ref)
    for name, want in ref.items():
        got = ours[name]
        if name.endswith("expert_ids"):
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, want, err_msg=f"{name} {context}")
        else:
            err = float(np.max(np.abs(got.astype(np.float32) - want)) / np.max(np.abs(want)))
            assert err <= 1e-5, (name, context, err)


def _segmented_rows():
    return hf_models.segmented_rows(SEQ)


@pytest.mark.parametrize("arch,impl", [(a, "blocked") for a in hf_models.MOE_ARCHS]
                         + [("qwen3_moe", "ragged"), ("qwen3_moe", "dense")])
def test_every_hook_matches_hf_on_each_document(ckpt_dir, monkeypatch, arch, impl):
    """Segmented rows (two documents in a row, padding, an all-padding row): router
    logits, the chosen experts (ids exactly) with their weights, and every activation."""
    monkeypatch.setattr(model_lib, "EXPERT_MATMULS", impl)
    path = ckpt_dir(arch)
    hf = hf_models.load_hf_model(path)
    docs, ids, pos, seg = _segmented_rows()
    ours = _extract(path, ids, positions=pos, segment_ids=seg)
    assert ours["layers.0.router_logits"].shape == (3, SEQ, hf.config.num_experts
                                                    if hasattr(hf.config, "num_experts")
                                                    else hf.config.num_local_experts)
    assert ours["layers.0.expert_ids"].shape == (3, SEQ, 2)
    for row, start, doc in ((0, 0, docs[0]), (0, 9, docs[1]), (1, 0, docs[2])):
        ref = hf_models.hf_hooks(hf, doc[None])
        got = {k: v[row, start:start + len(doc)][None] for k, v in ours.items()}
        _assert_hooks_equal(got, ref, f"row {row} start {start}")


def test_router_logits_are_hfs_output_router_logits(ckpt_dir):
    import torch

    path = ckpt_dir("olmoe")
    hf = hf_models.load_hf_model(path)
    ids = np.random.RandomState(3).randint(1, 512, (2, SEQ)).astype(np.int32)
    with torch.no_grad():
        out = hf(input_ids=torch.as_tensor(ids, dtype=torch.long), output_router_logits=True)
    ours = _extract(path, ids, hooks="layers.*.router_logits")
    for i, logits in enumerate(out.router_logits):
        want = logits.float().numpy().reshape(2, SEQ, -1)
        assert float(np.max(np.abs(ours[f"layers.{i}.router_logits"] - want))
                     / np.max(np.abs(want))) <= 1e-5


def test_long_documents_through_the_cache_match_hf(tmp_path):
    """Documents of up to 12 rows through the chain schedule and the KV cache: the
    router's hooks too equal HF run on each whole document."""
    max_context = 24
    path = hf_models.make_tiny_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe")
    hf = hf_models.load_hf_model(path)
    model = model_lib.load_pretrained(path)
    fn = step.make_extract_fn(
        model, capture.CaptureSpec.parse(long_docs.HOOKS + "," + ROUTER),
        max_context=max_context)
    docs = long_docs._documents(0, max_context)
    block = long_docs._packed(docs, runspec.PackingSpec("segmented", long_docs.SEQ_LEN,
                                                        max_context=max_context))
    stored = long_docs.run_rows(fn, block, local_batch=3)
    assert "layers.1.expert_ids" in stored
    long_docs.assert_documents_match_hf(stored, block, docs, hf, max_context, rtol=1e-5)


def test_tied_experts_give_hfs_output(ckpt_dir, tmp_path):
    """Experts 1 and 5 made identical (router rows and weights): their probabilities tie
    exactly on every token. torch.topk orders tied values by its sort, not by index (on
    the CPU it returns [4, 7, 2] for three ties at 2, 4 and 7), so which of the two leads,
    or is kept where the tie falls on the k-th place, is torch's; actx puts the lower id
    first. Either way the MLP output is HF's, and the chosen ids agree once 5 is read as
    its twin 1."""
    import torch
    import transformers

    path = str(tmp_path / "tied")
    config = hf_models.tiny_config("olmoe")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.copy_(0.5 * torch.randn_like(layer.mlp.gate.weight))
            layer.mlp.gate.weight[5] = layer.mlp.gate.weight[1]
            for name in ("gate_up_proj", "down_proj"):
                getattr(layer.mlp.experts, name)[5] = getattr(layer.mlp.experts, name)[1]
    hf.save_pretrained(path)
    ids = np.random.RandomState(4).randint(1, 512, (2, SEQ)).astype(np.int32)
    ref = hf_models.hf_hooks(hf, ids)
    ours = _extract(path, ids)
    for name, want in ref.items():
        if name.endswith("expert_ids"):
            canonical = lambda x: np.sort(np.where(x == 5, 1, x), axis=-1)  # noqa: E731
            np.testing.assert_array_equal(canonical(ours[name]), canonical(want), name)
            both = (ours[name] == 1).any(-1) & (ours[name] == 5).any(-1)
            first = np.argmax(np.isin(ours[name], (1, 5)), axis=-1)
            assert (np.take_along_axis(ours[name], first[..., None], -1)[..., 0][both]
                    == 1).all()  # the lower id first where both are chosen
        elif name.endswith("expert_weights"):
            np.testing.assert_allclose(np.sort(ours[name], -1), np.sort(want, -1),
                                       rtol=1e-5)
        else:
            err = float(np.max(np.abs(ours[name] - want)) / np.max(np.abs(want)))
            assert err <= 1e-5, (name, err)


def test_route_breaks_ties_by_lower_expert_id():
    class Cfg:
        experts_per_token, norm_topk_prob, router_weights_fp32 = 3, True, False

    h = np.ones((1, 1, 2), np.float32)
    router = np.asarray([[0.1, 0], [0.3, 0], [0.3, 0], [0.2, 0], [0.3, 0]], np.float32)
    _, ids, weights = moe.route(h, router, Cfg)
    assert ids.tolist() == [[[1, 2, 4]]]
    np.testing.assert_allclose(np.asarray(weights), 1 / 3, rtol=1e-6)


@pytest.mark.parametrize("arch,data,model_size,expert_spec", [
    # 8 experts over model=4: whole experts per device (expert parallelism).
    ("qwen3_moe", 2, 4, PartitionSpec(None, "model", None, None)),
    # 4 experts do not split 8 ways: each expert's width splits instead.
    ("mixtral", 1, 8, PartitionSpec(None, None, None, "model")),
])
def test_experts_shard_over_the_mesh(ckpt_dir, arch, data, model_size, expert_spec):
    path = ckpt_dir(arch)
    rng = np.random.RandomState(5)
    ids = rng.randint(1, 512, (8, 16)).astype(np.int32)
    single = _extract(path, ids)
    mesh = sharding.make_mesh(data=data, model=model_size)
    model = model_lib.load_pretrained(path, mesh=mesh)
    assert model.params["layers"]["expert_gate_ledf"].sharding.spec == expert_spec
    out = step.make_extract_fn(model, capture.CaptureSpec.parse(ALL_HOOKS))(ids)
    for name, want in single.items():
        got = np.asarray(out[name])
        if name.endswith("expert_ids"):
            np.testing.assert_array_equal(got, want, name)
        else:
            assert float(np.max(np.abs(got - want)) / np.max(np.abs(want))) <= 1e-5, name


def test_router_hook_on_a_dense_model_is_refused_before_any_work(tmp_path,
                                                                qwen_tokenizer_dir, capsys):
    model = preflight_tests._config_only_model(tmp_path / "m",
                                               vocab_size=preflight_tests.QWEN_VOCAB)
    cfg = preflight_tests._config(tmp_path, model, qwen_tokenizer_dir,
                                  preflight_tests._texts(tmp_path),
                                  "layers.0.resid_post,layers.*.router_logits")
    assert cli.main(["submit", cfg], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "router_logits: Qwen2ForCausalLM has no such point (it is not a mixture of " \
           "experts); its per-layer points: resid_pre, resid_mid, resid_post, attn_out, " \
           "mlp_out" in err
    assert not (tmp_path / "run").exists()


def test_moe_hook_names_and_dtypes(ckpt_dir):
    path = ckpt_dir("mixtral")
    ids = np.ones((1, 4), np.int32)
    out = _extract(path, ids, hooks="layers.1.experts,layers.0.router_logits")
    assert sorted(out) == ["layers.0.router_logits", "layers.1.expert_ids",
                           "layers.1.expert_weights"]
    assert out["layers.1.expert_ids"].dtype == np.int32
    assert out["layers.1.expert_weights"].dtype == np.float32
    assert out["layers.0.router_logits"].shape == (1, 4, 4)


def test_router_hooks_through_a_worker_and_the_reader(tmp_path, ckpt_dir):
    """A worker with --model-parallel 2 stores the router's hooks in the run directory
    (expert ids as int32, recorded in activations/actx.json), and the reader reads them:
    every token's values are HF's on its document."""
    from actx import reader
    from actx.schemas import activations_info, store
    from tests import token_runs, worker_procs

    path = ckpt_dir("olmoe")
    run = str(tmp_path / "run")
    hooks = "layers.1.resid_post,layers.1.experts,layers.0.router_logits"
    spec = token_runs.write_token_run(run, path, n_rows=8, hooks=hooks)
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "2",
                                         "--model-parallel", "2",
                                         "--expect-fingerprint", spec.fingerprint])
    assert code == 0, out
    info = activations_info.read_info(store.open_store(run))
    assert info.hooks == {"layers.1.resid_post": 64, "layers.1.expert_ids": 2,
                          "layers.1.expert_weights": 2, "layers.0.router_logits": 8}
    assert info.hook_dtypes == {"layers.1.expert_ids": "int32"}
    stored = {h: token_runs.read_activation(run, h) for h in info.hooks}
    assert stored["layers.1.expert_ids"].dtype == np.int32
    ids, seg, doc = (token_runs.read_tokens(run, n) for n in ("input_ids", "segment_ids",
                                                              "doc_index"))
    hf = hf_models.load_hf_model(path)
    for d in np.unique(doc[doc >= 0])[:6]:
        r, c = np.nonzero(doc == d)
        ref = hf_models.hf_hooks(hf, ids[r, c][None])
        _assert_hooks_equal({h: v[r, c][None] for h, v in stored.items()},
                            {h: ref[h] for h in info.hooks}, f"document {d}")
    with reader.open_run(run).batches("layers.1.expert_ids", batch_size=16, seed=0,
                                      drop_last=False, prefetch=1) as batches:
        seen = 0
        for b in batches:
            got = b.acts["layers.1.expert_ids"]
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, stored["layers.1.expert_ids"][b.rows, b.cols])
            assert (seg[b.rows, b.cols] > 0).all()
            seen += len(b.rows)
    assert seen == int((seg > 0).sum())
    # verify reads each hook at its recorded dtype, in the array and in the commit
    # markers (the ids int32, the rest float32).
    import io

    from actx.deploy import cli
    from actx.schemas import commit

    out = io.StringIO()
    assert cli.main(["verify", run], out=out) == 0, out.getvalue()
    marker = commit.read_marker(store.open_store(run), 0)
    assert marker.dtypes["layers.1.expert_ids"] == "int32"
    assert marker.dtypes["layers.1.expert_weights"] == "float32"


def test_step_cost_counts_the_active_experts():
    """FLOPs follow k, not the expert count (beyond the router's logits); the weights a
    step reads are those of the experts its tokens can reach; a MoE of k experts of width
    f / k costs what a dense MLP of width f does, plus its router."""
    import dataclasses

    from actx.workers.loop import admission
    from actx.workers.model.config import ModelConfig

    dense = ModelConfig("Qwen3ForCausalLM", 2, 64, 512, 4, 2, 16, 128)
    moe_cfg = dataclasses.replace(dense, architecture="Qwen3MoeForCausalLM", num_experts=8,
                                  experts_per_token=2, moe_intermediate_size=64)
    many = dataclasses.replace(moe_cfg, num_experts=64)
    tokens, router = 1000, lambda cfg: 2 * cfg.num_layers * tokens * 64 * cfg.num_experts
    cost = {c: admission.step_cost(c, tokens) for c in (dense, moe_cfg, many)}
    assert cost[moe_cfg].flops - router(moe_cfg) == cost[dense].flops
    assert cost[many].flops - router(many) == cost[dense].flops
    expert_bytes = 3 * 64 * 64 * 2
    one_token = admission.step_cost(many, 1).weight_bytes
    assert admission.step_cost(many, 2).weight_bytes - one_token == 2 * expert_bytes * 2 + 64 * 2
    assert admission.step_cost(many, 10 ** 6).weight_bytes == admission.step_cost(
        many, 32).weight_bytes + (10 ** 6 - 32) * 64 * 2  # every expert reached: no more
    assert admission.moe_scratch_bytes(dense, 4, 16, 2) == 0 < admission.moe_scratch_bytes(
        moe_cfg, 4, 16, 2)


def test_capture_spec_reads_router_points():
    spec = capture.CaptureSpec.parse("layers.0-1.experts,layers.1.router_logits,embed")
    assert spec.hook_names(2) == ["embed", "layers.0.expert_ids", "layers.0.expert_weights",
                                  "layers.1.expert_ids", "layers.1.expert_weights",
                                  "layers.1.router_logits"]
    with pytest.raises(ValueError, match=r"did you mean 'router_logits'"):
        capture.CaptureSpec.parse("layers.0.router_logit")
    assert capture.hook_dtypes(spec.hook_names(2), "bfloat16") == {
        "layers.0.expert_ids": "int32", "layers.1.expert_ids": "int32"}
    assert capture.hook_dtypes(["layers.0.resid_post"], "bfloat16") is None


def test_expert_matmul_forms_agree_across_block_edges(monkeypatch):
    """Groups of several blocks, groups that end inside a block, and experts no token
    chose (routing forced onto 3 of 8): the blocked, ragged and dense forms give the same
    sums."""
    import jax

    monkeypatch.setattr(moe, "BLOCK_ROWS", 4)

    class Cfg:
        experts_per_token, norm_topk_prob, router_weights_fp32 = 2, False, False

    rng = np.random.default_rng(7)
    e, d, f = 8, 16, 8
    router = rng.normal(0, 0.5, (e, d)).astype(np.float32)
    router[3:7] -= 100 * np.abs(router[3:7]).sum(-1, keepdims=True) / d  # rarely chosen
    p = {"router_weight_led": router,
         "expert_gate_ledf": rng.normal(0, 0.3, (e, d, f)).astype(np.float32),
         "expert_up_ledf": rng.normal(0, 0.3, (e, d, f)).astype(np.float32),
         "expert_down_lefd": rng.normal(0, 0.3, (e, f, d)).astype(np.float32)}
    h = rng.normal(0, 1, (2, 37, d)).astype(np.float32)
    _, ids, weights = moe.route(h, p["router_weight_led"], Cfg)
    assert len(np.unique(np.asarray(ids))) < e  # some experts have no rows
    outs = {impl: np.asarray(moe.experts(h, ids, weights, p, moe.swiglu(jax.nn.silu), impl))
            for impl in moe.IMPLEMENTATIONS}
    # The reference: each token's chosen experts, one at a time, in numpy float64.
    want = np.zeros(h.shape)
    for bi, ti in np.ndindex(h.shape[:2]):
        for e_id, w in zip(np.asarray(ids)[bi, ti], np.asarray(weights)[bi, ti]):
            x = h[bi, ti].astype(np.float64)
            gate, up = x @ p["expert_gate_ledf"][e_id], x @ p["expert_up_ledf"][e_id]
            want[bi, ti] += w * ((gate / (1 + np.exp(-gate)) * up) @ p["expert_down_lefd"][e_id])
    for impl, got in outs.items():
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=impl)

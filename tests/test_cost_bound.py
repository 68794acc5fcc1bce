"""The dry run's bound for accelerator targets (deploy.cost_bound): the forward's FLOPs per
token against HF's own parameters, and the peak of the slice a target names."""

from __future__ import annotations

import json

import pytest

from actx.deploy import config as config_lib, cost_bound
from actx.schemas import runspec
from actx.workers import preflight as workers_preflight
from actx.workers.model import families
from tests import hf_models


def _hf_matmul_params_per_token(model, layers: int) -> int:
    """The matrix parameters a token meets in the first `layers` blocks of HF's model: every
    2-D-or-more weight (norms are vectors, biases too), an expert's counted once per expert
    the router picks for a token."""
    cfg = model.config
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    total = 0
    for i, layer in enumerate(hf_models.decoder(model).layers):
        if i >= layers:
            break
        for name, p in layer.named_parameters():
            if p.ndim < 2 or name.endswith("bias"):  # gpt-oss stacks its experts' biases
                continue
            if ".experts." in f".{name}":
                # One tensor per expert ([experts, ...]) or one module per expert.
                per_expert = p.numel() // experts if p.shape[0] == experts else p.numel()
                share = cfg.num_experts_per_tok if p.shape[0] == experts else \
                    cfg.num_experts_per_tok / experts
                total += per_expert * share
            else:
                total += p.numel()
    return int(total)


@pytest.mark.parametrize("arch", ["qwen2", "llama3", "gemma2", "phi3", "olmo2", "qwen3_moe",
                                  "olmoe", "mixtral", "qwen3_moe_mixed", "qwen2_moe",
                                  "gpt_oss"])
def test_flops_per_token_are_twice_the_parameters_a_token_meets(tmp_path, arch):
    path = hf_models.make_tiny_checkpoint(tmp_path / arch, arch)
    model = hf_models.load_hf_model(path)
    # As the dry run has it: the workers' reading of config.json (text_config unwrapped).
    config = families.config_from_hf(json.load(open(f"{path}/config.json")))
    layers = config.num_layers
    heads, head_dim = model.config.num_attention_heads, (
        getattr(model.config, "head_dim", None) or model.config.hidden_size
        // model.config.num_attention_heads)
    for run in range(1, layers + 1):
        for seq_len in (16, 64):
            # Scores and the weighted sum: 2 FLOPs per multiply-add, over half a row.
            attention = run * 2 * 2 * heads * head_dim * seq_len / 2
            assert cost_bound.forward_flops_per_token(config, run, seq_len) == pytest.approx(
                2 * _hf_matmul_params_per_token(model, run) + attention, rel=1e-9)


@pytest.mark.parametrize("hooks", ["layers.0.resid_post", "layers.1.resid_post,layers.0.mlp_out",
                                   "embed,layers.2.attn_out", "layers.0.resid_pre,final_norm",
                                   "embed"])
def test_the_dry_runs_blocks_are_those_the_workers_scan_runs(tmp_path, hooks):
    """The blocks the bound counts (workers.preflight.hook_shapes, from config.json alone)
    are the scan's length in the workers' traced step for the same hooks."""
    import re

    import jax
    import numpy as np

    from actx.workers.model import capture, decoder as model_lib, step

    path = hf_models.make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")  # 3 layers
    spec = runspec.RunSpec(model=runspec.ModelSpec(path=str(path)),
                           tokenizer=runspec.TokenizerSpec(path="tok"),
                           sources=(runspec.SourceSpec(kind="text", paths=("x.jsonl",)),),
                           capture=runspec.CaptureConfig(hooks=hooks, dtype="float32"))
    shapes = workers_preflight.hook_shapes(spec)
    assert shapes.why == "" and shapes.config.num_layers == 3
    fn = step.make_extract_fn(model_lib.load_pretrained(str(path)),
                              capture.CaptureSpec.parse(hooks))
    ids = np.ones((1, 8), np.int32)
    jaxpr = str(jax.make_jaxpr(fn._jitted)(fn._params, ids, ids, ids))
    scanned = [int(n) for n in re.findall(r"length=(\d+)", jaxpr)]
    assert scanned == ([shapes.blocks] if shapes.blocks else []), (hooks, scanned)
    assert sorted(shapes.hooks) == fn.hook_names


def test_the_peak_of_what_a_target_names():
    tpu = config_lib.TargetConfig(kind="tpu-vm", tpu=config_lib.TpuConfig(
        name="t", accelerator_type="v5litepod-16"))
    peak, what = cost_bound.target_peak(tpu)
    assert peak == 16 * 197e12 and what == "a v5litepod-16 (16 chips x 197 TFLOP/s bf16)"
    v4 = config_lib.TargetConfig(kind="tpu-vm", tpu=config_lib.TpuConfig(
        name="t", accelerator_type="v4-32"))  # 32 TensorCores: 16 chips
    assert cost_bound.target_peak(v4)[0] == 16 * 275e12

    def dataflow(**kw):
        return config_lib.TargetConfig(kind="dataflow", extract="beam",
                                       dataflow=config_lib.DataflowConfig(**kw))

    peak, what = cost_bound.target_peak(dataflow(
        max_num_workers=4, extract_accelerator="type:nvidia-l4;count:2;install-nvidia-driver"))
    assert peak == 4 * 2 * 121e12 and "4 Dataflow worker(s) x 2 nvidia-l4" in what
    peak, _ = cost_bound.target_peak(dataflow(
        max_num_workers=2, extract_accelerator="type:tpu-v5-lite-podslice;topology:2x2"))
    assert peak == 2 * 4 * 197e12
    for kw, why in [({"max_num_workers": 4}, "CPU workers"),
                    ({"extract_accelerator": "type:nvidia-l4;count:1"}, "max_num_workers is 0"),
                    ({"max_num_workers": 1, "extract_accelerator": "type:weird"},
                     "'weird' has no peak figure")]:
        peak, said = cost_bound.target_peak(dataflow(**kw))
        assert peak is None and why in said, said
    prepare_only = config_lib.TargetConfig(kind="dataflow", dataflow=config_lib.DataflowConfig(
        max_num_workers=4, extract_accelerator="type:nvidia-l4;count:1"))
    assert "only prepares" in cost_bound.target_peak(prepare_only)[1]


def test_each_target_knows_its_own_hardware():
    """The bound asks the target (`Target.peak_flops`) and branches on no target's kind;
    every registered kind answers, with a reason where it names no accelerator."""
    import ast
    import pathlib

    source = pathlib.Path(cost_bound.__file__).read_text()
    kinds = [n for n in ast.walk(ast.parse(source))
             if isinstance(n, ast.Attribute) and n.attr == "kind"]
    assert not kinds, "deploy/cost_bound.py branches on a target's kind"
    from actx.deploy import targets

    for kind in targets.KINDS:
        peak, why = cost_bound.target_peak(config_lib.TargetConfig(kind=kind, **(
            {"tpu": config_lib.TpuConfig(name="t", accelerator_type="v6e-8")}
            if kind == "tpu-vm" else {})))
        if kind == "tpu-vm":
            assert peak == 8 * 918e12, why
        else:
            assert peak is None and why, (kind, why)

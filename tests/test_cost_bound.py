"""The dry run's bound for accelerator targets (deploy.cost_bound): the forward's FLOPs per
token against HF's own parameters, and the peak of the slice a target names."""

from __future__ import annotations

import json

import pytest

from actx.deploy import config as config_lib, cost_bound
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
            if p.ndim < 2:
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


@pytest.mark.parametrize("arch", ["qwen2", "llama3", "gemma2", "phi3", "olmo2", "qwen3_moe", "olmoe",
                                  "mixtral"])
def test_flops_per_token_are_twice_the_parameters_a_token_meets(tmp_path, arch):
    path = hf_models.make_tiny_checkpoint(tmp_path / arch, arch)
    model = hf_models.load_hf_model(path)
    config = json.load(open(f"{path}/config.json"))
    config = config.get("text_config") or config
    layers = config["num_hidden_layers"]
    heads, head_dim = model.config.num_attention_heads, (
        getattr(model.config, "head_dim", None) or model.config.hidden_size
        // model.config.num_attention_heads)
    for run in range(1, layers + 1):
        for seq_len in (16, 64):
            # Scores and the weighted sum: 2 FLOPs per multiply-add, over half a row.
            attention = run * 2 * 2 * heads * head_dim * seq_len / 2
            assert cost_bound.forward_flops_per_token(config, run, seq_len) == pytest.approx(
                2 * _hf_matmul_params_per_token(model, run) + attention, rel=1e-9)


def test_layers_run_follow_the_hooks():
    assert cost_bound.layers_run(["layers.0.resid_post", "layers.5.attn_out"], 12) == 6
    assert cost_bound.layers_run(["embed", "final_norm"], 12) == 12
    assert cost_bound.layers_run(["embed"], 12) == 0


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

"""The least time a job can take on a target's accelerators: its forward FLOPs over their
peak (`actx submit --dry-run --estimate` on the tpu-vm and dataflow targets).

A dry run cannot time the target's hardware from here, so it gives the bound that holds
whatever the software: tokens x the forward's FLOPs per token (up to the last hooked
layer, no LM head: actx never computes one) / (chips x their peak bf16 FLOP/s). A real
forward reaches a fraction of that peak; the fraction is not known before the job runs
(bench/RESULTS.md has measured ones for GPUs), so the line says "at least".
"""

from __future__ import annotations

from actx.deploy.targets.tpu_vm import accelerators as tpu_types

# Peak dense bf16 (fp16 where the card has no bf16) tensor FLOP/s per chip, from the
# vendors' published specifications (Cloud TPU system architecture pages, NVIDIA data
# sheets; dense, without structured sparsity).
TPU_PEAK_TFLOPS = {"v2": 45.0, "v3": 123.0, "v4": 275.0, "v5p": 459.0, "v5litepod": 197.0,
                   "v6e": 918.0}
GPU_PEAK_TFLOPS = {"nvidia-tesla-t4": 65.0, "nvidia-tesla-v100": 125.0, "nvidia-l4": 121.0,
                   "nvidia-tesla-a100": 312.0, "nvidia-a100-80gb": 312.0,
                   "nvidia-h100-80gb": 989.0, "nvidia-h100-mega-80gb": 989.0,
                   "nvidia-h200-141gb": 989.0}
# Dataflow's TPU worker_accelerator types -> the generation's name in tpu_types.
DATAFLOW_TPU = {"tpu-v5-lite-podslice": "v5litepod", "tpu-v5p-slice": "v5p",
                "tpu-v6e-slice": "v6e", "tpu-v4-podslice": "v4"}


def forward_flops_per_token(config, blocks: int, seq_len: int) -> float:
    """2 x the parameters a token meets in `blocks` decoder blocks (a mixture of experts':
    its experts per token's) plus attention's scores and weighted sum over half a row on
    average (causal). config: the checkpoint's workers ModelConfig (hidden_size,
    num_heads, num_kv_heads, head_dim, intermediate_size, num_experts, experts_per_token,
    moe_intermediate_size), as workers.preflight.hook_shapes read it; blocks: its blocks
    run for the hooks, by the same rule."""
    hidden, heads, head_dim = config.hidden_size, config.num_heads, config.head_dim
    experts = config.num_experts
    per_token = config.experts_per_token if experts else 1
    inter = config.moe_intermediate_size if experts else config.intermediate_size
    attention = hidden * heads * head_dim * 2 + hidden * config.num_kv_heads * head_dim * 2
    mlp = 3 * hidden * inter * per_token + hidden * experts
    context = 2 * 2 * heads * head_dim * (seq_len / 2)
    return blocks * (2 * (attention + mlp) + context)


def target_peak(target) -> tuple[float, str] | tuple[None, str]:
    """(peak FLOP/s of all the target's accelerators, what they are) or (None, why not)."""
    if target.kind == "tpu-vm":
        shape = tpu_types.parse(target.tpu.accelerator_type)
        gen = tpu_types.ALIASES.get(shape.accelerator_type.split("-")[0],
                                    shape.accelerator_type.split("-")[0])
        peak = TPU_PEAK_TFLOPS[gen]
        return (shape.chips * peak * 1e12,
                f"a {shape.accelerator_type} ({shape.chips} chips x {peak:g} TFLOP/s bf16)")
    if target.kind == "dataflow" and target.extract != "beam":
        return None, ("the dataflow target only prepares here; the extraction's time is the "
                      "target's that runs it (`actx rerun RUN --config` there)")
    if target.kind == "dataflow":
        fields = dict(part.split(":", 1) for part in target.dataflow.extract_accelerator.split(";")
                      if ":" in part)
        kind = fields.get("type", "")
        workers = target.dataflow.max_num_workers
        if not kind:
            return None, ("the extraction runs on Dataflow's CPU workers "
                          "(dataflow.extract_accelerator is empty), whose speed is not known here")
        if not workers:
            return None, "dataflow.max_num_workers is 0 (autoscaled): the workers are not known"
        if kind in GPU_PEAK_TFLOPS:
            count = int(fields.get("count", "1"))
            peak = GPU_PEAK_TFLOPS[kind]
            return (workers * count * peak * 1e12,
                    f"{workers} Dataflow worker(s) x {count} {kind} ({peak:g} TFLOP/s bf16 each)")
        if kind in DATAFLOW_TPU:
            chips = 1
            for n in fields.get("topology", "1x1").split("x"):
                chips *= int(n)
            peak = TPU_PEAK_TFLOPS[DATAFLOW_TPU[kind]]
            return (workers * chips * peak * 1e12,
                    f"{workers} Dataflow worker(s) x {chips} {kind} chip(s) ({peak:g} TFLOP/s "
                    f"bf16 each)")
        return None, f"dataflow.extract_accelerator type {kind!r} has no peak figure here"
    return None, f"the {target.kind} target has no accelerator table here"

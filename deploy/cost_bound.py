"""The least time a job can take on a target's accelerators: its forward FLOPs over their
peak (`actx submit --dry-run --estimate` on the tpu-vm and dataflow targets).

A dry run cannot time the target's hardware from here, so it gives the bound that holds
whatever the software: tokens x the forward's FLOPs per token (up to the last hooked
layer, no LM head: actx never computes one) / (chips x their peak bf16 FLOP/s). Each
target knows its accelerators' peak (`Target.peak_flops`: the TPU generations' table,
Dataflow's worker accelerators); this module asks it. A real forward reaches a fraction
of that peak; the fraction is not known before the job runs (bench/RESULTS.md has
measured ones for GPUs), so the line says "at least".
"""

from __future__ import annotations

from actx.deploy import targets


def forward_flops_per_token(config, blocks: int, seq_len: int) -> float:
    """2 x the parameters a token meets in `blocks` decoder blocks (a mixture of experts':
    its experts per token's) plus attention's scores and weighted sum over half a row on
    average (causal). config: the checkpoint's workers ModelConfig (hidden_size,
    num_heads, num_kv_heads, head_dim, intermediate_size, num_experts, experts_per_token,
    moe_intermediate_size), as workers.preflight.hook_shapes read it; blocks: its blocks
    run for the hooks, by the same rule."""
    hidden, heads, head_dim = config.hidden_size, config.num_heads, config.head_dim
    experts = config.num_experts
    attention = hidden * heads * head_dim * 2 + hidden * config.num_kv_heads * head_dim * 2
    shared = getattr(config, "shared_expert_size", 0)  # Qwen2-MoE's, and its gate
    sparse_mlp = (3 * hidden * config.moe_intermediate_size * config.experts_per_token
                  + hidden * experts + (3 * hidden * shared + hidden if shared else 0))
    dense_mlp = 3 * hidden * config.intermediate_size
    # Each block's own MLP (dense layers between a mixture's sparse ones).
    layers = getattr(config, "moe_per_layer", (bool(experts),) * blocks)[:blocks]
    mlp = sum(sparse_mlp if sparse else dense_mlp for sparse in layers)
    context = 2 * 2 * heads * head_dim * (seq_len / 2)
    return blocks * (2 * attention + context) + 2 * mlp


def target_peak(target) -> tuple[float, str] | tuple[None, str]:
    """(peak FLOP/s of all the target's accelerators, what they are) or (None, why not), as
    the target (or the one its TargetConfig names) knows its own hardware."""
    return targets.as_target(target).peak_flops()

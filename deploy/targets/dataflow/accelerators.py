"""The accelerators a Dataflow worker can carry (`dataflow.extract_accelerator`, as
Dataflow's `worker_accelerator` service option writes it: `type:nvidia-l4;count:2` or
`type:tpu-v5-lite-podslice;topology:2x2`), and their peak: what the dry run's bound of an
extraction through Beam on Dataflow's workers needs (deploy.cost_bound)."""

from __future__ import annotations

from actx.deploy.targets.tpu_vm import accelerators as tpu_types

# Peak dense bf16 (fp16 where the card has no bf16) tensor TFLOP/s per card, from NVIDIA's
# data sheets (dense, without structured sparsity).
GPU_PEAK_TFLOPS = {"nvidia-tesla-t4": 65.0, "nvidia-tesla-v100": 125.0, "nvidia-l4": 121.0,
                   "nvidia-tesla-a100": 312.0, "nvidia-a100-80gb": 312.0,
                   "nvidia-h100-80gb": 989.0, "nvidia-h100-mega-80gb": 989.0,
                   "nvidia-h200-141gb": 989.0}
# Dataflow's TPU worker_accelerator types -> the Cloud TPU generation (tpu_vm.accelerators).
TPU_GENERATION = {"tpu-v5-lite-podslice": "v5litepod", "tpu-v5p-slice": "v5p",
                  "tpu-v6e-slice": "v6e", "tpu-v4-podslice": "v4"}


def worker_peak(extract_accelerator: str, workers: int) -> tuple[float | None, str]:
    """(peak FLOP/s of `workers` Dataflow workers each carrying `extract_accelerator`, what
    they are) or (None, why it is not known here)."""
    fields = dict(part.split(":", 1) for part in extract_accelerator.split(";") if ":" in part)
    kind = fields.get("type", "")
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
    if kind in TPU_GENERATION:
        chips = 1
        for n in fields.get("topology", "1x1").split("x"):
            chips *= int(n)
        peak = tpu_types.GENERATIONS[TPU_GENERATION[kind]].peak_tflops
        return (workers * chips * peak * 1e12,
                f"{workers} Dataflow worker(s) x {chips} {kind} chip(s) ({peak:g} TFLOP/s "
                f"bf16 each)")
    return None, f"dataflow.extract_accelerator type {kind!r} has no peak figure here"

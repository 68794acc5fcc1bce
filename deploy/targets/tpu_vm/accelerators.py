"""Cloud TPU accelerator types: what a name like "v4-32" or "v5litepod-16" means.

One table per generation says how the number in the name counts (TensorCores or chips),
how many chips one host holds, which sizes exist and what one chip computes at peak; hosts,
chips, JAX devices and the peak FLOP/s of a slice derive from it. Checked before anything is created, so a typo costs no slice.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Generation:
    """cores_per_chip: the name counts TensorCores when 2 (v2-v4, v5p), chips when 1.
    chips_per_host: chips of one host in a multi-host slice.
    single_host_chips: the largest slice that is one host (v5e/v6e: 8 chips).
    devices_per_chip: JAX devices per chip (v2/v3 show each TensorCore; v4/v5p megacore).
    sizes: the numbers the name may carry.
    peak_tflops: one chip's peak dense bf16 TFLOP/s, from the Cloud TPU system architecture
      pages (the bound `actx submit --dry-run --estimate` gives; deploy.cost_bound).
    """

    cores_per_chip: int
    chips_per_host: int
    single_host_chips: int
    devices_per_chip: int
    sizes: tuple[int, ...]
    peak_tflops: float


def _powers(lo: int, hi: int) -> tuple[int, ...]:
    return tuple(2 ** i for i in range(hi.bit_length()) if lo <= 2 ** i <= hi)


# Sizes from Cloud TPU's documented slice shapes (v4 and v5p also take non-power-of-two
# 3D shapes: any multiple of 8 TensorCores, which the table accepts).
GENERATIONS = {
    "v2": Generation(2, 4, 4, 2, _powers(8, 512), 45.0),
    "v3": Generation(2, 4, 4, 2, _powers(8, 2048), 123.0),
    "v4": Generation(2, 4, 4, 1, tuple(range(8, 8193, 8)), 275.0),
    "v5p": Generation(2, 4, 4, 1, tuple(range(8, 12289, 8)), 459.0),
    "v5litepod": Generation(1, 4, 8, 1, (1, 4, 8, 16, 32, 64, 128, 256), 197.0),
    "v6e": Generation(1, 4, 8, 1, (1, 4, 8, 16, 32, 64, 128, 256), 918.0),
}
ALIASES = {"v5e": "v5litepod"}


@dataclasses.dataclass(frozen=True)
class SliceShape:
    accelerator_type: str
    hosts: int
    chips: int
    devices_per_host: int
    chip_tflops: float  # one chip's peak dense bf16 TFLOP/s

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host


def parse(accelerator_type: str) -> SliceShape:
    """The slice an accelerator type names; ValueError saying what exists otherwise."""
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", accelerator_type or "")
    gen_name = ALIASES.get(m.group(1), m.group(1)) if m else None
    if gen_name not in GENERATIONS:
        raise ValueError(f"accelerator type {accelerator_type!r} is not a Cloud TPU type; "
                         f"expected <generation>-<size> with generation one of "
                         f"{', '.join(sorted(GENERATIONS))} (e.g. v4-32, v5litepod-16)")
    gen = GENERATIONS[gen_name]
    size = int(m.group(2))
    if size not in gen.sizes:
        shown = (", ".join(map(str, gen.sizes)) if len(gen.sizes) <= 12
                 else f"multiples of 8 from {gen.sizes[0]} to {gen.sizes[-1]}")
        raise ValueError(f"accelerator type {accelerator_type!r}: {gen_name} slices come in "
                         f"sizes {shown}")
    chips = max(1, size // gen.cores_per_chip)
    hosts = 1 if chips <= gen.single_host_chips else chips // gen.chips_per_host
    return SliceShape(accelerator_type, hosts, chips, chips // hosts * gen.devices_per_chip,
                      gen.peak_tflops)

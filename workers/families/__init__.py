"""The model families actx reads, one module each, and the registry that finds a family by
its HF architecture. See `base.Family` for what a family describes; adding a dense family
that differs only in tensor names is one module here plus its tests."""

from __future__ import annotations

from actx.workers.families import gemma, llama, mixtral, olmo, phi3, qwen
from actx.workers.families.base import Family, LayerTensor

# In the order errors list them (the first six as actx has always listed them).
FAMILIES: tuple[Family, ...] = (qwen.QWEN2, llama.LLAMA, llama.MISTRAL, qwen.QWEN3,
                                gemma.GEMMA2, gemma.GEMMA3, phi3.PHI3, olmo.OLMO2,
                                qwen.QWEN3_MOE, olmo.OLMOE, mixtral.MIXTRAL)
_BY_ARCH: dict[str, Family] = {a: f for f in FAMILIES for a in f.architectures}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_BY_ARCH)

__all__ = ["FAMILIES", "SUPPORTED_ARCHITECTURES", "Family", "LayerTensor", "for_architecture"]


def for_architecture(arch: str) -> Family:
    """The family that reads HF architecture `arch`; KeyError if none does."""
    return _BY_ARCH[arch]

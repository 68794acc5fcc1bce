"""The model families actx reads, one module each; the registry that finds a family by its
HF architecture; and the reader of an HF `config.json` into a `ModelConfig`, which finds
the family and lets it read its own fields. See `base.Family` for what a family describes;
adding a dense family that differs only in tensor names is one module here plus its tests.

Dependencies run one way: this registry and the family modules import
`workers.model.config`; the config knows no family.
"""

from __future__ import annotations

from typing import Any, Mapping

from actx.workers.model.config import ModelConfig
from actx.workers.model.families import (gemma, gpt2, gpt_neox, gpt_oss, hf_defaults,
                                        hf_fields, llama, mixtral, olmo, phi3, qwen)
from actx.workers.model.families.base import DENSE_POINTS, Family, LayerTensor

# In the order errors list them (the first six as actx has always listed them).
FAMILIES: tuple[Family, ...] = (qwen.QWEN2, llama.LLAMA, llama.MISTRAL, qwen.QWEN3,
                                gemma.GEMMA2, gemma.GEMMA3, phi3.PHI3, olmo.OLMO2,
                                qwen.QWEN3_MOE, olmo.OLMOE, mixtral.MIXTRAL, gpt2.GPT2,
                                gpt_neox.GPT_NEOX, qwen.QWEN2_MOE,
                                gpt_oss.GPT_OSS)
_BY_ARCH: dict[str, Family] = {a: f for f in FAMILIES for a in f.architectures}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_BY_ARCH)

__all__ = ["FAMILIES", "SUPPORTED_ARCHITECTURES", "Family", "LayerTensor", "config_from_hf",
           "for_architecture", "layer_points", "missing_points", "of", "quantization_method"]


def for_architecture(arch: str) -> Family:
    """The family that reads HF architecture `arch`; KeyError if none does."""
    return _BY_ARCH[arch]


def of(cfg: ModelConfig) -> Family:
    """The family of a model's config."""
    return _BY_ARCH[cfg.architecture]


def layer_points(cfg) -> tuple[str, ...]:
    """The per-layer hook points `cfg`'s model has (a dense model's for a config of no
    family here, such as a test's stand-in)."""
    family = _BY_ARCH.get(getattr(cfg, "architecture", None))
    return family.hook_points(cfg) if family is not None else DENSE_POINTS


def missing_points(cfg) -> dict[str, str]:
    """{dense point: why `cfg`'s model has no such point} (a parallel block's resid_mid)."""
    family = _BY_ARCH.get(getattr(cfg, "architecture", None))
    return family.missing_points(cfg) if family is not None else {}


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Reads an HF config dict: the shape fields common to every family here, the rest by
    the family its architecture names. Raises ValueError naming any unsupported field."""
    architectures = hf.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source}: unsupported architectures={architectures!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    arch = architectures[0]
    family = for_architecture(arch)
    _refuse_quantization(hf.get("quantization_config"), family, arch, source)
    if arch in family.text_tower:
        # The language model's own config; the vision tower is never read.
        if not isinstance(hf.get("text_config"), Mapping):
            raise ValueError(f"{source}: {arch} without a text_config")
        hf = hf["text_config"]
        source = f"{source} (text_config)"
        arch = family.text_tower[arch]
        _refuse_quantization(hf.get("quantization_config"), family, arch, source)

    def refuse(field: str, value: Any, why: str = "") -> ValueError:
        return ValueError(f"{source}: unsupported option {field}={value!r} for {arch}"
                          + (f" ({why})" if why else ""))

    # A field config.json leaves out is HF's class default (hf_defaults), as HF reads it.
    hf = hf_defaults.with_defaults(hf, arch, family.hf_names)
    if family.hf_names:
        # The family's own names for the common fields (GPT-2's n_embd, n_layer, ...).
        hf = {**hf, **{common: hf[own] for common, own in family.hf_names.items()
                       if own in hf}}
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    num_layers = int(hf["num_hidden_layers"])
    head_dim = int(hf.get("head_dim") or hidden // num_heads)
    options = dict(family.options(hf, arch, refuse, num_layers, head_dim))
    rope = options.pop("rope", None) or hf_fields.rope_from_hf(hf, refuse)
    tie_default = options.pop("tie_default", False)
    common = dict(
        architecture=arch,
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=int(hf["vocab_size"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        intermediate_size=int(hf.get("intermediate_size") or 0),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", tie_default)),
        max_position_embeddings=int(hf.get("max_position_embeddings") or 0),
    )
    # A family's options may set a common field its own way (GPT-2's n_inner default,
    # LayerNorm's epsilon).
    return ModelConfig(**{**common, **options})


def quantization_method(quant: Any) -> str | None:
    """The method of a config's `quantization_config`, as transformers' AutoQuantizationConfig
    names it (load_in_8bit / load_in_4bit: bitsandbytes); None where there is none."""
    if quant is None or quant == {}:
        return None
    if not isinstance(quant, Mapping):
        return repr(quant)
    if quant.get("load_in_8bit") or quant.get("load_in_4bit"):
        return "bitsandbytes"
    return str(quant.get("quant_method"))


def _refuse_quantization(quant: Any, family: Family, arch: str, source: str) -> None:
    """A checkpoint quantised in a way its family does not read is refused by name before
    any weight is read: its integer or float8 tensors are not the model's weights (read as
    floats, they would compute something else without a word)."""
    method = quantization_method(quant)
    if method is None or method in family.quantizations:
        return
    if family.quantizations:
        implemented = (f"{arch} reads {', '.join(family.quantizations)} checkpoints or "
                       f"unquantised ones")
    else:
        implemented = "actx reads unquantised float weights only"
    raise ValueError(
        f"{source}: unsupported option quantization_config.quant_method={method!r} for "
        f"{arch} ({implemented}; use the unquantised checkpoint the quantised one was made "
        f"from, e.g. the original model's repository, or dequantise it and save it without "
        f"quantization_config)")

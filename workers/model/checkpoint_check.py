"""Checkpoint integrity before any work, from the safetensors headers alone (a few KB per
file, local or gs://): every header parses, every file is as long as its header says, and
every tensor the architecture needs is there with the config's shape and a float dtype.

Without it a truncated download or a checkpoint of another size is found by the workers,
after a full prepare. It also holds the table of the tensors a decoder needs (HF name and
shape from config.json, from the family description in `workers.model.families`), which
`workers.model.checkpoint` reads by. No JAX here.
"""

from __future__ import annotations

import json
import struct

from actx.schemas import store as store_lib
from actx.workers.model import families
from actx.workers.model.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
# The dtypes `workers.model.checkpoint` reads and casts (safetensors' names).
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
# MXFP4's blocks and scales (workers.model.mxfp4), where the config says the checkpoint
# is quantised.
PACKED_DTYPES = ("U8",)
PACKED_SUFFIXES = ("_blocks", "_scales")
# A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100 << 20


def hf_layer_tensors(cfg: ModelConfig) -> dict:
    """Our layer param -> its `families.LayerTensor` (HF name(s) under model.layers.{i}.,
    HF shape, layout change), from the model's family description."""
    return families.of(cfg).layer_tensors(cfg)


def hf_top_tensors(cfg: ModelConfig) -> dict:
    """Our top-level param (embed_vd, final_norm_d, a family's others) -> its
    `families.LayerTensor` (HF name under the decoder prefix)."""
    return families.of(cfg).top_tensors(cfg)


def layers_at(cfg: ModelConfig | None) -> str:
    """The layers' list under the decoder prefix ("layers"; GPT-2's "h")."""
    return "layers" if cfg is None else families.of(cfg).layers_at


# Where Llama-shaped checkpoints keep the decoder (`families.base.DECODER_PREFIXES`); a
# family may name its own (GPT-2's `transformer.`, GPT-NeoX's `gpt_neox.`).
DECODER_PREFIXES = families.base.DECODER_PREFIXES


def _prefixes_and_embed(cfg: ModelConfig | None) -> tuple[tuple[str, ...], str]:
    if cfg is None:
        return DECODER_PREFIXES, "embed_tokens.weight"
    return families.of(cfg).prefixes, hf_top_tensors(cfg)["embed_vd"].hf


def decoder_prefix(tensor_names, source: str = "", cfg: ModelConfig | None = None) -> str:
    """The prefix of the decoder's tensors among `tensor_names`: the first of the family's
    prefixes (`cfg`'s; Llama-shaped ones without it) under which its embedding is."""
    prefixes, embed = _prefixes_and_embed(cfg)
    for prefix in prefixes:
        if f"{prefix}{embed}" in tensor_names:
            return prefix
    raise ValueError(f"{source}: checkpoint has no embedding tensor "
                     f"({' or '.join(p + embed for p in prefixes)})")


def needed_tensors(cfg: ModelConfig, prefix: str | None = None) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the decoder reads (no LM head: activations need none), with its
    shape from config.json; `prefix`: where the checkpoint keeps the decoder (the
    family's first by default)."""
    if prefix is None:
        prefix = families.of(cfg).prefixes[0]
    needed = {f"{prefix}{tensor.hf}": tensor.hf_shape
              for tensor in hf_top_tensors(cfg).values()}
    at = layers_at(cfg)
    for tensor in hf_layer_tensors(cfg).values():
        for i in range(cfg.num_layers):
            if not tensor.held_by(i):
                continue
            for suffix, shape in tensor.stored().items():
                needed[f"{prefix}{at}.{i}.{suffix}"] = shape
    return needed


def _header(store, where: str, name: str, problems: list[str]) -> dict | None:
    """The safetensors header of `name`, or None with the reason added to `problems`."""
    size = store.size(name)
    if size is None:
        problems.append(f"spec.model.path: {where}/{INDEX_FILE} lists {name}, which is "
                        f"missing")
        return None
    damaged = "; the file is damaged or incomplete: download it again"
    where = f"spec.model.path: {where}"
    if size < 8:
        problems.append(f"{where}/{name}: {size} bytes, too short for a safetensors file"
                        + damaged)
        return None
    (header_len,) = struct.unpack("<Q", store.read_range(name, 0, 8))
    if header_len > min(MAX_HEADER_BYTES, size - 8):
        problems.append(f"{where}/{name}: its header claims {header_len} bytes, the file has "
                        f"{size}" + damaged)
        return None
    try:
        header = json.loads(store.read_range(name, 8, 8 + header_len))
        ends = [entry["data_offsets"][1] for key, entry in header.items()
                if key != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError) as e:
        problems.append(f"{where}/{name}: the safetensors header does not parse ({e})"
                        + damaged)
        return None
    expected = 8 + header_len + max(ends, default=0)
    if size != expected:
        problems.append(f"{where}/{name}: {size:,} bytes, but its header describes "
                        f"{expected:,}" + damaged)
    return header


def problems(path: str, cfg: ModelConfig) -> tuple[list[str], list[str]]:
    """(problems, missing): what is wrong with the checkpoint's safetensors files, one line
    each, all at once; missing: no weights at all (a dry run may come before the upload).
    Store failures (no credentials, no network) raise store_errors.StoreError."""
    store = store_lib.open_store(path)  # the model's checkpoint, not the run
    where = str(store.location)
    found: list[str] = []
    index = store.read_json(INDEX_FILE)
    if index is not None:
        files = sorted(set((index.get("weight_map") or {}).values()))
    else:
        files = sorted(k for k in store.list() if k.endswith(".safetensors") and "/" not in k)
    if not files:
        return [], [f"spec.model.path: {where}: no *.safetensors files (and no {INDEX_FILE}); "
                    f"point it at a Hugging Face checkpoint directory"]
    tensors: dict[str, tuple[str, dict]] = {}
    damaged = 0
    for name in files:
        header = _header(store, where, name, found)
        damaged += header is None
        for key, entry in (header or {}).items():
            if key != "__metadata__":
                tensors[key] = (name, entry)
    missing, wrong = [], []
    prefixes, embed = _prefixes_and_embed(cfg)
    prefix = next((p for p in prefixes if f"{p}{embed}" in tensors), prefixes[0])
    for tensor, shape in needed_tensors(cfg, prefix).items():
        if tensor not in tensors:
            missing.append(tensor)
            continue
        name, entry = tensors[tensor]
        if tuple(entry.get("shape", ())) != shape:
            wrong.append(f"{where}/{name}: tensor {tensor} has shape "
                         f"{tuple(entry.get('shape', ()))}, config.json says {shape}")
        elif entry.get("dtype") not in (PACKED_DTYPES if tensor.endswith(PACKED_SUFFIXES)
                                        else FLOAT_DTYPES):
            wrong.append(f"{where}/{name}: tensor {tensor} has dtype {entry.get('dtype')}; "
                         f"actx reads float weights ({', '.join(FLOAT_DTYPES)})")
    if missing and not damaged:  # a damaged file explains its own tensors
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3
                                          else "")
        found.append(f"spec.model.path: {where}: {len(missing)} tensor(s) the model needs are "
                     f"in none of its safetensors files: {shown}; the checkpoint is "
                     f"incomplete or of another architecture")
    found += [f"spec.model.path: {line}" for line in wrong[:3]]
    if len(wrong) > 3:
        found.append(f"spec.model.path: and {len(wrong) - 3} more tensor(s) whose shape or "
                     f"dtype does not match config.json")
    return found, []

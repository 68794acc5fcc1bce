"""Reads HF safetensors checkpoints (local or any tensorstore kvstore, e.g. gs://) into
the decoder's stacked parameter layout, without torch.

Each weight is checked against the config (name, expected and actual shape), transposed
into the einsum layout of `workers.model` (e.g. q_proj [n*h, d] -> q_weight_ldnh
[layers, d, n, h]), cast, and placed straight into its NamedSharding when a mesh is given.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import tempfile
from typing import Callable, Iterator, Mapping

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open

from actx.schemas import ts_context
from actx.schemas import uri as uri_lib
from actx.workers import checkpoint_check
from actx.workers import sharding
from actx.workers.model_config import ModelConfig

# Our parameter tree: name -> logical axes. Names carry the shape letters:
# v vocab, d hidden, l layers, n heads, k kv heads, h head dim, f MLP width.
TOP_PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed_vd": ("vocab", "embed"),
    "final_norm_d": ("embed",),
}
LAYER_PARAM_AXES: dict[str, tuple[str, ...]] = {
    "attn_norm_ld": ("layers", "embed"),
    "q_weight_ldnh": ("layers", "embed", "heads", "head_dim"),
    "q_bias_lnh": ("layers", "heads", "head_dim"),
    "k_weight_ldkh": ("layers", "embed", "kv_heads", "head_dim"),
    "k_bias_lkh": ("layers", "kv_heads", "head_dim"),
    "v_weight_ldkh": ("layers", "embed", "kv_heads", "head_dim"),
    "v_bias_lkh": ("layers", "kv_heads", "head_dim"),
    "o_weight_lnhd": ("layers", "heads", "head_dim", "embed"),
    "mlp_norm_ld": ("layers", "embed"),
    "gate_weight_ldf": ("layers", "embed", "mlp"),
    "up_weight_ldf": ("layers", "embed", "mlp"),
    "down_weight_lfd": ("layers", "mlp", "embed"),
    # Qwen3 and Gemma 3: RMSNorm over each head's queries / keys.
    "q_norm_lh": ("layers", "head_dim"),
    "k_norm_lh": ("layers", "head_dim"),
    # Gemma 2 and 3: the norms after attention and around the MLP.
    "attn_post_norm_ld": ("layers", "embed"),
    "mlp_post_norm_ld": ("layers", "embed"),
}
_BIAS_PARAMS = ("q_bias_lnh", "k_bias_lkh", "v_bias_lkh")
_QK_NORM_PARAMS = ("q_norm_lh", "k_norm_lh")
_GEMMA_NORM_PARAMS = ("attn_post_norm_ld", "mlp_post_norm_ld")

_RAW_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32,
               "F64": np.float64}


# HF layout -> ours, for each layer tensor of checkpoint_check.hf_layer_tensors.
def _to_ours(cfg: ModelConfig) -> dict[str, Callable]:
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return {
        "attn_norm_ld": lambda w: w,
        "q_weight_ldnh": lambda w: w.T.reshape(d, n, h),
        "k_weight_ldkh": lambda w: w.T.reshape(d, k, h),
        "v_weight_ldkh": lambda w: w.T.reshape(d, k, h),
        "o_weight_lnhd": lambda w: w.T.reshape(n, h, d),
        "mlp_norm_ld": lambda w: w,
        "gate_weight_ldf": lambda w: w.T,
        "up_weight_ldf": lambda w: w.T,
        "down_weight_lfd": lambda w: w.T,
        "q_bias_lnh": lambda b: b.reshape(n, h),
        "k_bias_lkh": lambda b: b.reshape(k, h),
        "v_bias_lkh": lambda b: b.reshape(k, h),
        "q_norm_lh": lambda w: w,
        "k_norm_lh": lambda w: w,
        "attn_post_norm_ld": lambda w: w,
        "mlp_post_norm_ld": lambda w: w,
    }


def _hf_layer_tensors(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], Callable]]:
    """Our layer param -> (HF name under model.layers.{i}., HF shape, HF -> ours)."""
    to_ours = _to_ours(cfg)
    return {ours: (suffix, shape, to_ours[ours])
            for ours, (suffix, shape) in checkpoint_check.hf_layer_tensors(cfg).items()}


def layer_param_names(cfg: ModelConfig) -> tuple[str, ...]:
    return tuple(n for n in LAYER_PARAM_AXES
                 if (cfg.qkv_bias or n not in _BIAS_PARAMS)
                 and (cfg.qk_norm or n not in _QK_NORM_PARAMS)
                 and (cfg.gemma_norms or n not in _GEMMA_NORM_PARAMS))


def decoder_prefix(reader: "TensorReader", source: str = "") -> str:
    """The prefix of the decoder's tensors in this checkpoint
    (`checkpoint_check.DECODER_PREFIXES`)."""
    return checkpoint_check.decoder_prefix(reader, source)


class TensorReader:
    """Name -> numpy array over the safetensors files of one checkpoint directory."""

    def __init__(self, directory: str):
        self.directory = directory
        index_path = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map: Mapping[str, str] = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p for p in os.listdir(directory) if p.endswith(".safetensors"))
            if not files:
                raise ValueError(f"{directory}: no *.safetensors files (and no "
                                 "model.safetensors.index.json)")
        self._file_of: dict[str, str] = {}
        self._headers: dict[str, dict] = {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                raise ValueError(f"{index_path} lists {name}, which is missing")
            with safe_open(path, framework="numpy") as f:
                for key in f.keys():
                    self._file_of[key] = path

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape_of(self, name: str) -> tuple[int, ...]:
        with safe_open(self._file_of[name], framework="numpy") as f:
            return tuple(f.get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        path = self._file_of[name]
        with safe_open(path, framework="numpy") as f:
            dtype = f.get_slice(name).get_dtype()
            if dtype != "BF16":
                return f.get_tensor(name)
        # numpy has no bfloat16, so safetensors' numpy API refuses BF16: read the raw
        # bytes from the file's (documented) header offsets and view them via ml_dtypes.
        return self._read_raw(path, name)

    def _read_raw(self, path: str, name: str) -> np.ndarray:
        if path not in self._headers:
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            header["__data_start__"] = 8 + header_len
            self._headers[path] = header
        header = self._headers[path]
        entry = header[name]
        begin, end = entry["data_offsets"]
        if entry["dtype"] not in _RAW_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {entry['dtype']}")
        raw = np.memmap(path, dtype=np.uint8, mode="r",
                        offset=header["__data_start__"] + begin, shape=(end - begin,))
        return raw.view(_RAW_DTYPES[entry["dtype"]]).reshape(entry["shape"])


@contextlib.contextmanager
def local_checkpoint_dir(path: str | os.PathLike) -> Iterator[str]:
    """Yields a local directory holding the checkpoint at `path` (local, gs://, memory://).

    Remote checkpoints are copied file by file through a tensorstore kvstore into a
    temporary directory that is removed afterwards.
    """
    location = uri_lib.parse(path)
    if location.is_local:
        if not os.path.isdir(location.path):
            raise ValueError(f"{path}: checkpoint directory does not exist")
        yield location.path
        return
    store = ts_context.open_kvstore(location.kvstore(directory=True))
    keys = [k.decode() for k in store.list().result()]
    wanted = [k for k in keys if "/" not in k and (
        k.endswith(".safetensors") or k in ("config.json", "model.safetensors.index.json"))]
    if "config.json" not in wanted:
        raise ValueError(f"{path}: no config.json in the checkpoint directory")
    with tempfile.TemporaryDirectory(prefix="actx-ckpt-") as tmp:
        for key in wanted:
            with open(os.path.join(tmp, key), "wb") as f:
                f.write(store.read(key).result().value)
        yield tmp


def _place(array: np.ndarray, axes: tuple[str, ...], mesh, name: str) -> jax.Array:
    if mesh is None:
        return jax.device_put(array)
    named = sharding.logical_sharding(axes, array.shape, mesh, name)
    # Each device receives only its own slice: no full copy lands on one device.
    return jax.make_array_from_callback(array.shape, named, lambda index: array[index])


def load_params(reader: TensorReader, cfg: ModelConfig, dtype: np.dtype,
                mesh=None, source: str = "") -> dict:
    """Reads, checks, transposes, stacks, casts and places all parameters."""

    def fetch(hf_name: str, expected: tuple[int, ...]) -> np.ndarray:
        if hf_name not in reader:
            raise ValueError(f"{source}: checkpoint is missing tensor {hf_name!r} "
                             f"(expected shape {expected})")
        actual = reader.shape_of(hf_name)
        if actual != expected:
            raise ValueError(f"{source}: tensor {hf_name!r} has shape {actual}, "
                             f"expected {expected} from config.json")
        return reader.read(hf_name)

    params: dict = {}
    prefix = decoder_prefix(reader, source)
    embed = fetch(f"{prefix}embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    params["embed_vd"] = _place(np.asarray(embed, dtype=dtype), TOP_PARAM_AXES["embed_vd"],
                                mesh, "embed_vd")
    final_norm = fetch(f"{prefix}norm.weight", (cfg.hidden_size,))
    params["final_norm_d"] = _place(np.asarray(final_norm, dtype=dtype),
                                    TOP_PARAM_AXES["final_norm_d"], mesh, "final_norm_d")
    layers = {}
    for ours, (hf_suffix, hf_shape, to_ours) in _hf_layer_tensors(cfg).items():
        stacked = np.stack([
            np.asarray(to_ours(fetch(f"{prefix}layers.{i}.{hf_suffix}", hf_shape)),
                       dtype=dtype)
            for i in range(cfg.num_layers)])
        layers[ours] = _place(stacked, LAYER_PARAM_AXES[ours], mesh, ours)
    params["layers"] = layers
    return params


def param_logical_axes(cfg: ModelConfig) -> dict:
    """The logical-axes tree matching `load_params`' output."""
    return {**TOP_PARAM_AXES,
            "layers": {n: LAYER_PARAM_AXES[n] for n in layer_param_names(cfg)}}


def digest(directory: str) -> str:
    """crc32c over config.json and the *.safetensors files (names and bytes, name order)."""
    import crc32c

    names = sorted(n for n in os.listdir(directory)
                   if n == "config.json" or n.endswith(".safetensors"))
    value = 0
    for name in names:
        value = crc32c.crc32c(name.encode(), value)
        with open(os.path.join(directory, name), "rb") as f:
            while chunk := f.read(64 << 20):
                value = crc32c.crc32c(chunk, value)
    return f"{value:08x}"


def local_weight_bytes(path) -> int | None:
    """Bytes of a local checkpoint directory's weight files, to say how much a load reads
    (None elsewhere: a gs:// checkpoint's size would cost a listing before the load)."""
    try:
        names = os.listdir(path)
    except (OSError, TypeError):
        return None
    return sum(os.path.getsize(os.path.join(path, n)) for n in names
               if n.endswith((".safetensors", ".bin"))) or None

"""Reads HF safetensors checkpoints (local or any tensorstore kvstore, e.g. gs://) into
the decoder's stacked parameter layout, without torch.

Each weight is checked against the config (name, expected and actual shape), transposed
into the einsum layout of `workers.model.decoder` (e.g. q_proj [n*h, d] -> q_weight_ldnh
[layers, d, n, h]), cast, and placed straight into its NamedSharding when a mesh is given.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import tempfile
from typing import Iterator, Mapping

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open

from actx.schemas import ts_context
from actx.schemas import uri as uri_lib
from actx.workers.model import checkpoint_check
from actx.workers.model import mxfp4
from actx.workers.model.families import base as families_base
from actx.workers.model import sharding
from actx.workers.model.config import ModelConfig

# Our parameter tree: name -> logical axes. The layer parameters, their axes and how each
# is read from HF tensors come from the model's family (workers.model.families); names carry the
# shape letters (v vocab, d hidden, l layers, n heads, k kv heads, h head dim, f MLP width,
# e experts).
TOP_PARAM_AXES: dict[str, tuple[str, ...]] = families_base.TOP_PARAM_AXES

_RAW_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32,
               "F64": np.float64}
# What `TensorReader.read` returns: float weights, and MXFP4's uint8 blocks and scales.
_READABLE_DTYPES = checkpoint_check.FLOAT_DTYPES + checkpoint_check.PACKED_DTYPES


def layer_param_axes(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Our layer parameter -> its logical axes, "layers" first."""
    return {name: ("layers",) + tensor.axes
            for name, tensor in checkpoint_check.hf_layer_tensors(cfg).items()}


def layer_param_names(cfg: ModelConfig) -> tuple[str, ...]:
    return tuple(checkpoint_check.hf_layer_tensors(cfg))


def decoder_prefix(reader: "TensorReader", source: str = "",
                   cfg: ModelConfig | None = None) -> str:
    """The prefix of the decoder's tensors in this checkpoint (the family's of `cfg`;
    `checkpoint_check.decoder_prefix`)."""
    return checkpoint_check.decoder_prefix(reader, source, cfg)


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
        return self.shape_and_dtype(name)[0]

    def shape_and_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        """The tensor's shape and its dtype as safetensors names it ("BF16", "F8_E4M3",
        "I8"), from one read of its file's header."""
        with safe_open(self._file_of[name], framework="numpy") as f:
            info = f.get_slice(name)
            return tuple(info.get_shape()), info.get_dtype()

    def read(self, name: str) -> np.ndarray:
        """The tensor as numpy: a float one, or the uint8 of packed MXFP4 blocks and
        scales; any other dtype (float8, integers: a quantised checkpoint) is refused,
        naming the tensor."""
        path = self._file_of[name]
        with safe_open(path, framework="numpy") as f:
            dtype = f.get_slice(name).get_dtype()
            if dtype not in _READABLE_DTYPES:
                raise ValueError(
                    f"{path}: tensor {name} has dtype {dtype}; actx reads float weights "
                    f"({', '.join(checkpoint_check.FLOAT_DTYPES)}): a quantised checkpoint "
                    f"(float8, int8, ...) is not read; use the unquantised checkpoint")
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
        actual, dtype = reader.shape_and_dtype(hf_name)
        if actual != expected:
            raise ValueError(f"{source}: tensor {hf_name!r} has shape {actual}, "
                             f"expected {expected} from config.json")
        packed = hf_name.endswith(checkpoint_check.PACKED_SUFFIXES)
        if dtype not in (checkpoint_check.PACKED_DTYPES if packed
                         else checkpoint_check.FLOAT_DTYPES):
            # The pre-flight's rule (checkpoint_check.problems), for the Python API too:
            # an integer or float8 tensor is a quantised checkpoint's, not the weights.
            raise ValueError(f"{source}: tensor {hf_name!r} has dtype {dtype}; actx reads "
                             f"float weights ({', '.join(checkpoint_check.FLOAT_DTYPES)}): "
                             f"use the unquantised checkpoint")
        return reader.read(hf_name)

    params: dict = {}
    prefix = decoder_prefix(reader, source, cfg)
    for ours, tensor in checkpoint_check.hf_top_tensors(cfg).items():
        params[ours] = _place(_part(fetch(f"{prefix}{tensor.hf}", tensor.hf_shape), tensor,
                                    dtype), tensor.axes, mesh, ours)
    at = checkpoint_check.layers_at(cfg)
    layers = {}
    for ours, tensor in checkpoint_check.hf_layer_tensors(cfg).items():
        per_layer = []
        absent = None  # the zeros a layer without this tensor holds (never read)
        for i in range(cfg.num_layers):
            if not tensor.held_by(i):
                if absent is None:
                    one = _part(np.zeros(tensor.hf_shape, dtype), tensor, dtype)
                    absent = np.zeros(((tensor.experts,) if tensor.experts else ())
                                      + one.shape, dtype)
                per_layer.append(absent)
                continue
            if tensor.mxfp4:
                packed = [fetch(f"{prefix}{at}.{i}.{name}", shape)
                          for name, shape in tensor.stored().items()]
                if tensor.packed_part is not None:
                    packed = [tensor.packed_part(p) for p in packed]
                parts = [_part(mxfp4.dequantize(*packed), tensor, dtype)]
            else:
                parts = [_part(fetch(f"{prefix}{at}.{i}.{name}", tensor.hf_shape), tensor,
                               dtype) for name in tensor.hf_names()]
            per_layer.append(np.stack(parts) if tensor.experts else parts[0])
        layers[ours] = _place(np.stack(per_layer), ("layers",) + tensor.axes, mesh, ours)
    params["layers"] = layers
    return params


def _part(hf_array: np.ndarray, tensor, dtype: np.dtype) -> np.ndarray:
    """One HF tensor in our layout and dtype: its rows of a fused tensor, transposed and
    reshaped."""
    if tensor.rows is not None:
        hf_array = hf_array[tensor.rows[0]:tensor.rows[1]]
    return np.asarray(tensor.to_ours(hf_array), dtype=dtype)


def param_logical_axes(cfg: ModelConfig) -> dict:
    """The logical-axes tree matching `load_params`' output."""
    return {**{name: tensor.axes
               for name, tensor in checkpoint_check.hf_top_tensors(cfg).items()},
            "layers": layer_param_axes(cfg)}


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

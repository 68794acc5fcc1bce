"""Where each token's activations lie in a local shard file, for hook arrays stored without
a codec, so the stream can copy them straight from the page cache (reader.storage.mapped_hook).

Follows the zarr v3 `sharding_indexed` codec (zarr-specs, codecs/sharding-indexed): a shard
object holds its inner chunks at any offsets, followed (index_location "end") by an index
of little-endian uint64 (offset, nbytes) pairs, one per inner chunk in C order of the
chunks-per-shard grid, both 2**64 - 1 for a chunk not stored (read as the fill value),
then the crc32c of the index (little-endian uint32). With the inner codec `bytes`
(little-endian) alone, an inner chunk is its C-order array, so a token's `hidden` values
are `hidden * itemsize` contiguous bytes.

Only that exact layout is accepted (what actx writes with codec "none"); anything else
(another codec, a transpose, the index at the start, a big-endian host or chunk, an index
whose checksum or sizes do not match) is refused with a reason, and the caller reads
through tensorstore instead. A wrong activation is worse than a slow one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import crc32c as crc32c_lib
import ml_dtypes
import numpy as np

MISSING = 2**64 - 1  # offset and nbytes of an inner chunk that is not stored
_INDEX_CHECKSUM_BYTES = 4
# The activation dtypes (schemas.layout.ITEMSIZE), little-endian.
_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype("<f2"),
           "float32": np.dtype("<f4"), "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn)}
_TOP_LEVEL_KEYS = {"zarr_format", "node_type", "shape", "data_type", "chunk_grid",
                   "chunk_key_encoding", "fill_value", "codecs", "attributes",
                   "dimension_names", "storage_transformers"}
_LITTLE_BYTES = {"name": "bytes", "configuration": {"endian": "little"}}


class Refused(Exception):
    """The array or a shard is not in the layout read here (the message says how)."""


@dataclasses.dataclass(frozen=True)
class PlainShards:
    """A [rows, seq_len, hidden] array sharded along rows only, inner chunks of
    [chunk_rows, chunk_tokens, hidden] stored as raw little-endian bytes."""

    shape: tuple[int, int, int]
    shard_rows: int
    chunk_rows: int
    chunk_tokens: int
    dtype: np.dtype
    fill: np.ndarray  # [hidden] of dtype: the value of every token of a missing chunk

    @property
    def hidden(self) -> int:
        return self.shape[2]

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's vector (one row of the [tokens, hidden] view)."""
        return self.hidden * self.dtype.itemsize

    @property
    def chunks_per_shard(self) -> tuple[int, int]:
        return self.shard_rows // self.chunk_rows, self.shape[1] // self.chunk_tokens

    @property
    def chunk_nbytes(self) -> int:
        return self.chunk_rows * self.chunk_tokens * self.row_bytes

    @property
    def index_nbytes(self) -> int:
        return 16 * math.prod(self.chunks_per_shard) + _INDEX_CHECKSUM_BYTES

    def token_grids(self) -> tuple[np.ndarray, np.ndarray]:
        """(inner chunk number, token number inside that chunk), int64 [shard_rows,
        seq_len] each: where the token at (row in shard, column) lies."""
        r = np.arange(self.shard_rows, dtype=np.int64)[:, None]
        c = np.arange(self.shape[1], dtype=np.int64)[None, :]
        chunk = (r // self.chunk_rows) * self.chunks_per_shard[1] + c // self.chunk_tokens
        inside = (r % self.chunk_rows) * self.chunk_tokens + c % self.chunk_tokens
        return chunk, inside


def _names(codecs) -> str:
    """Codecs in a short form for messages: "bytes(endian=little), zstd(level=3)"."""
    return ", ".join(f"{c.get('name')}(" + ", ".join(
        f"{k}={v}" for k, v in c.get("configuration", {}).items()) + ")"
        for c in codecs or []) or "none"


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise Refused(what)


def plain_shards(metadata: dict, shape: tuple[int, ...], dtype: np.dtype,
                 fill_value: np.ndarray) -> PlainShards:
    """The layout of an array from its zarr.json `metadata`, checked against what
    tensorstore opened (shape, dtype, fill value); raises Refused unless every part of
    it is the one layout read here."""
    _expect(sys.byteorder == "little", "this host is big-endian")
    _expect(set(metadata) <= _TOP_LEVEL_KEYS,
            f"unknown metadata members {sorted(set(metadata) - _TOP_LEVEL_KEYS)}")
    _expect(metadata.get("zarr_format") == 3 and metadata.get("node_type") == "array",
            "not a zarr v3 array")
    _expect(not metadata.get("storage_transformers"), "storage transformers")
    _expect(list(metadata.get("shape", ())) == list(shape) and len(shape) == 3,
            f"shape {metadata.get('shape')} is not tensorstore's {list(shape)}")
    name = metadata.get("data_type")
    _expect(name in _DTYPES and _DTYPES[name] == dtype,
            f"data type {name!r} (tensorstore: {dtype})")
    encoding = metadata.get("chunk_key_encoding", {})
    _expect(encoding.get("name") == "default"
            and encoding.get("configuration", {}).get("separator", "/") == "/",
            f"chunk key encoding {encoding}")
    grid = metadata.get("chunk_grid", {})
    _expect(grid.get("name") == "regular", f"chunk grid {grid.get('name')!r}")
    shard = list(grid.get("configuration", {}).get("chunk_shape", ()))
    _expect(len(shard) == 3 and shard[1:] == list(shape[1:]) and shard[0] >= 1,
            f"shards {shard} do not hold whole rows of {list(shape[1:])}")
    codecs = metadata.get("codecs", [])
    _expect(len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed",
            f"codecs {[c.get('name') for c in codecs]} are not one sharding_indexed")
    config = codecs[0].get("configuration", {})
    _expect(set(config) <= {"chunk_shape", "codecs", "index_codecs", "index_location"},
            f"sharding members {sorted(config)}")
    # A one-byte type (float8) has no byte order: tensorstore writes bytes() without one.
    plain = [[_LITTLE_BYTES]] + ([[{"name": "bytes"}]] if dtype.itemsize == 1 else [])
    _expect(config.get("codecs") in plain,
            f"inner codecs {_names(config.get('codecs'))}: only bytes(endian=little) is "
            f"read here")
    _expect(config.get("index_codecs") == [_LITTLE_BYTES, {"name": "crc32c"}],
            f"index codecs {_names(config.get('index_codecs'))}")
    _expect(config.get("index_location", "end") == "end",
            f"index location {config.get('index_location')!r}")
    inner = list(config.get("chunk_shape", ()))
    _expect(len(inner) == 3 and inner[2] == shape[2] and min(inner) >= 1
            and shard[0] % inner[0] == 0 and shard[1] % inner[1] == 0,
            f"inner chunks {inner} do not tile shards {shard} along whole token vectors")
    fill = metadata.get("fill_value")
    _expect(isinstance(fill, (int, float)) and not isinstance(fill, bool)
            and math.isfinite(fill), f"fill value {fill!r}")
    ours = np.asarray(fill, dtype)
    _expect(fill_value is not None and np.asarray(fill_value, dtype).tobytes() == ours.tobytes(),
            f"fill value {fill!r} is not tensorstore's {fill_value!r}")
    return PlainShards(shape=(int(shape[0]), int(shape[1]), int(shape[2])),
                       shard_rows=int(shard[0]), chunk_rows=int(inner[0]),
                       chunk_tokens=int(inner[1]), dtype=dtype,
                       fill=np.full(int(shape[2]), ours, dtype))


def read_metadata(path: str) -> dict:
    """The zarr.json at `path` (raises Refused when it cannot be read as JSON)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as e:
        raise Refused(f"{path}: {e}") from None


def chunk_rows_in_file(layout: PlainShards, index: bytes, file_bytes: int) -> np.ndarray:
    """First row of each inner chunk in the file seen as [file_bytes // row_bytes, hidden]
    (int64 [chunks per shard], C order; -1: not stored, the fill value), from the shard's
    trailing `index` bytes; raises Refused unless every entry is a whole, uncompressed
    chunk inside the file's data, starting at a multiple of row_bytes."""
    _expect(len(index) == layout.index_nbytes and file_bytes >= layout.index_nbytes,
            f"{file_bytes} bytes cannot hold an index of {layout.index_nbytes}")
    body = index[:-_INDEX_CHECKSUM_BYTES]
    stored = int.from_bytes(index[-_INDEX_CHECKSUM_BYTES:], "little")
    _expect(crc32c_lib.crc32c(body) == stored, "the shard index checksum does not match")
    entries = np.frombuffer(body, "<u8").reshape(-1, 2)
    offset, nbytes = entries[:, 0], entries[:, 1]
    missing = (offset == MISSING) & (nbytes == MISSING)
    stored_ = ~missing
    _expect(bool(np.all(nbytes[stored_] == layout.chunk_nbytes)),
            f"inner chunks of {sorted(set(nbytes[stored_].tolist()))} bytes, not "
            f"{layout.chunk_nbytes}")
    last_start = file_bytes - layout.index_nbytes - layout.chunk_nbytes  # may be < 0
    _expect(not stored_.any() or (last_start >= 0 and bool(
        np.all(offset[stored_] <= np.uint64(last_start)))),
            "an inner chunk reaches past the file's data")
    _expect(bool(np.all(offset[stored_] % layout.row_bytes == 0)),
            f"an inner chunk starts off a multiple of {layout.row_bytes} bytes")
    return np.where(missing, -1, (offset // layout.row_bytes).astype(np.int64))


def read_index(fd: int, layout: PlainShards) -> tuple[int, bytes]:
    """(file size, its trailing index bytes) of an open shard file."""
    size = os.fstat(fd).st_size
    if size < layout.index_nbytes:
        return size, b""
    return size, os.pread(fd, layout.index_nbytes, size - layout.index_nbytes)

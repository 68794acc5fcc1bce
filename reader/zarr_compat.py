"""Lets zarr-python 3 read the run's bfloat16 activation arrays.

zarr-python 3.1 has no bfloat16 data type (float16 and float32 arrays open as they are);
the zarr v3 spec names "bfloat16" as an extension type, and tensorstore writes it as
2-byte little-endian values. Registering a data type backed by ml_dtypes.bfloat16 makes
`zarr.open_array` return the same values tensorstore and this reader read.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

_BF16 = np.dtype(ml_dtypes.bfloat16)
_REGISTERED = False


def register_bfloat16() -> None:
    """Registers a bfloat16 data type with zarr-python (idempotent; imports zarr)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from zarr.core.dtype import data_type_registry
    from zarr.core.dtype.npy.float import Float16

    # Float16 already handles 2-byte floats (JSON fill values, endianness, item size);
    # only the native dtype and the names differ.
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class BFloat16(Float16):
        dtype_cls = type(_BF16)
        _zarr_v3_name = "bfloat16"
        _zarr_v2_names = ()

        def to_native_dtype(self):
            return _BF16

        @classmethod
        def from_native_dtype(cls, dtype):
            if np.dtype(dtype) == _BF16:
                return cls()
            raise TypeError(f"not bfloat16: {dtype}")

        def _cast_scalar_unchecked(self, data):
            return _BF16.type(data)

    data_type_registry.register("bfloat16", BFloat16)
    _REGISTERED = True

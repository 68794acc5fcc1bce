"""Lets zarr-python 3 read the run's bfloat16 and float8 activation arrays.

zarr-python 3.1 has neither bfloat16 nor float8 data types (float16 and float32 arrays
open as they are); the zarr v3 spec names "bfloat16" as an extension type, and tensorstore
writes it as 2-byte little-endian values, and float8_e4m3fn (a float8 run's values,
schemas.quantised) as one byte each. Registering data types backed by ml_dtypes makes
`zarr.open_array` return the same values tensorstore and this reader read.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

_BF16 = np.dtype(ml_dtypes.bfloat16)
# The float8 types a run may store (schemas.quantised.FORMATS' stored names).
_FLOAT8 = {"float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn)}
_REGISTERED = False


def _data_type(name: str, native: np.dtype, item_size: int):
    """A zarr-python data type named `name` in zarr v3 JSON, backed by numpy dtype `native`."""
    from zarr.core.dtype.npy.float import Float16

    # Float16 already handles floats' JSON fill values and endianness; only the native
    # dtype, the names and (for float8) the item size differ.
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Registered(Float16):
        dtype_cls = type(native)
        _zarr_v3_name = name
        _zarr_v2_names = ()

        @property
        def item_size(self) -> int:
            return item_size

        def to_native_dtype(self):
            return native

        @classmethod
        def from_native_dtype(cls, dtype):
            if np.dtype(dtype) == native:
                return cls()
            raise TypeError(f"not {name}: {dtype}")

        def _cast_scalar_unchecked(self, data):
            return native.type(data)

    Registered.__name__ = Registered.__qualname__ = name.title().replace("_", "")
    return Registered


def register_dtypes() -> None:
    """Registers bfloat16 and float8_e4m3fn with zarr-python (idempotent; imports zarr)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from zarr.core.dtype import data_type_registry

    data_type_registry.register("bfloat16", _data_type("bfloat16", _BF16, 2))
    for name, native in _FLOAT8.items():
        data_type_registry.register(name, _data_type(name, native, 1))
    _REGISTERED = True


# Its earlier name: it registers the float8 types too.
register_bfloat16 = register_dtypes

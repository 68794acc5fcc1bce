"""Shuffled reading against the sequential decoded read of the same store, in one run.

    python bench/read.py                          # synthetic bf16 runs, zstd and no codec
    python bench/read.py --codec none --rows 512  # one codec, a bigger store
    python bench/read.py --run ./runs/r1 --hook layers.12.resid_post

For each store it prints: (1) the sequential decoded read (every block of the hook read
through tensorstore in row order, a few reads in flight, decoded to numpy, padding
included); (2) the streaming shuffle (`run.stream`) over one whole epoch: the same blocks
read and decoded, plus the permutation and the batch copies; its ratio is (1)'s time over
(2)'s for the same bytes; (3) the exact global shuffle (`run.batches`, straight from the
arrays) over a few steps; the peak RSS of each (each runs in its own process, so the
figure is its own); and how mixed the batches are (reader.mixing: distinct documents,
partitions and blocks per batch) for (2) and (3). Modes alternate over --reps repeats and
the median is printed, because other processes share the cores. The files were just
written or read, so reads come from the page cache: the figures are decode and copy speed,
not disk speed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import reader  # noqa: E402
from reader import mixing  # noqa: E402


def _peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM, not ru_maxrss: ru_maxrss survives
    exec, so a child would report the parent's peak (the synthetic store it built)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: KiB


def sequential(run: reader.Run, hook: str, block_rows: int, in_flight: int = 4) -> dict:
    """Decoded bytes/s of reading every committed block in row order."""
    array = run.activation_array(hook)
    blocks = [(lo, min(lo + block_rows, p.row_stop)) for p in run.committed_partitions
              for lo in range(p.row_start, p.row_stop, block_rows)]
    t0 = time.perf_counter()
    futures, nbytes = [], 0
    for lo, hi in blocks:
        futures.append(array[lo:hi].read())
        if len(futures) >= in_flight:
            nbytes += futures.pop(0).result().nbytes
    nbytes += sum(f.result().nbytes for f in futures)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "decoded_bytes": nbytes, "gb_s": nbytes / seconds / 1e9}


def stream(run: reader.Run, hook: str, batch_size: int, buffer_tokens: int,
           block_rows: int, mix_batches: int) -> dict:
    """One whole epoch of the streaming shuffle (drop_last=False: every valid token)."""
    kwargs = dict(buffer_tokens=buffer_tokens, block_rows=block_rows, seed=0,
                  drop_last=False)
    t0 = time.perf_counter()
    s = run.stream(hook, batch_size, **kwargs)
    setup_s = time.perf_counter() - t0
    tokens = nbytes = 0
    t0 = time.perf_counter()
    with s:
        for b in s:
            tokens += len(b)
            nbytes += b.acts[hook].nbytes
    seconds = time.perf_counter() - t0
    decoded = sum(int(hi - lo) for lo, hi in zip(s.plan.table.row_start,
                                                 s.plan.table.row_stop))
    decoded *= run.seq_len * run.hook(hook).hidden * np.dtype(
        run.activation_array(hook).dtype.numpy_dtype).itemsize
    with run.stream(hook, batch_size, **kwargs) as again:
        mix = mixing.measure(run, (b for _, b in zip(range(mix_batches), again)),
                             block_rows=block_rows)
    return {"seconds": seconds, "setup_s": setup_s, "tokens": tokens,
            "tokens_s": tokens / seconds, "gb_s": nbytes / seconds / 1e9,
            "decoded_bytes": decoded, "blocks_per_buffer": s.blocks_per_buffer,
            "mixing": mix.as_dict()}


def exact(run: reader.Run, hook: str, batch_size: int, steps: int, block_rows: int,
          mix_batches: int) -> dict:
    """The exact global permutation read straight from the arrays, `steps` batches."""
    t0 = time.perf_counter()
    batches = run.batches(hook, batch_size, seed=0, epochs=None, prefetch=2)
    setup_s = time.perf_counter() - t0
    kept = []
    with batches:
        it = iter(batches)
        kept.append(next(it))  # warm-up: shard indexes into the cache
        tokens = nbytes = 0
        t0 = time.perf_counter()
        for _ in range(steps):
            b = next(it)
            tokens, nbytes = tokens + len(b), nbytes + b.acts[hook].nbytes
            if len(kept) < mix_batches:
                kept.append(b)
        seconds = time.perf_counter() - t0
    mix = mixing.measure(run, kept, block_rows=block_rows)
    return {"seconds": seconds, "setup_s": setup_s, "tokens_s": tokens / seconds,
            "gb_s": nbytes / seconds / 1e9, "mixing": mix.as_dict()}


def measure(args: argparse.Namespace) -> None:
    """One mode in this process; prints its figures as one JSON line."""
    run = reader.open_run(args.run)
    hook = args.hook or next(iter(run.hooks))
    block_rows = args.block_rows or run.spec.layout.rows_per_shard
    if args.measure == "sequential":
        out = sequential(run, hook, block_rows)
    elif args.measure == "stream":
        out = stream(run, hook, args.batch_size, args.buffer_tokens, block_rows,
                     args.mix_batches)
    else:
        out = exact(run, hook, args.batch_size, args.exact_steps, block_rows,
                    args.mix_batches)
    out["peak_rss_mb"] = _peak_rss_mb()
    print(json.dumps(out))


def _child(args: argparse.Namespace, mode: str, run_dir: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", mode, "--run", run_dir,
           "--batch-size", str(args.batch_size), "--buffer-tokens", str(args.buffer_tokens),
           "--exact-steps", str(args.exact_steps), "--mix-batches", str(args.mix_batches)]
    if args.hook:
        cmd += ["--hook", args.hook]
    if args.block_rows:
        cmd += ["--block-rows", str(args.block_rows)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(args: argparse.Namespace, run_dir: str, label: str) -> None:
    """Alternates the modes over --reps repeats in child processes; prints medians."""
    seq, strm = [], []
    for _ in range(args.reps):
        seq.append(_child(args, "sequential", run_dir))
        strm.append(_child(args, "stream", run_dir))
    ex = _child(args, "exact", run_dir)
    med = statistics.median
    seq_s, strm_s = med(r["seconds"] for r in seq), med(r["seconds"] for r in strm)
    seq_gb_s = med(r["gb_s"] for r in seq)
    s0 = strm[0]
    print(f"\n== {label}: batch {args.batch_size} tokens, buffer {args.buffer_tokens} "
          f"tokens ({s0['blocks_per_buffer']} blocks), median of {args.reps}")
    print(f"sequential decoded read:  {seq_gb_s:7.3f} GB/s decoded "
          f"({seq[0]['decoded_bytes'] / 1e9:.3f} GB, {seq_s:.2f} s)   "
          f"peak RSS {max(r['peak_rss_mb'] for r in seq):,.0f} MB")
    print(f"streaming shuffle:        {med(r['gb_s'] for r in strm):7.3f} GB/s delivered, "
          f"{s0['decoded_bytes'] / strm_s / 1e9:.3f} GB/s decoded "
          f"({med(r['tokens_s'] for r in strm):,.0f} tokens/s, {strm_s:.2f} s/epoch)   "
          f"ratio to sequential {seq_s / strm_s:.3f}   "
          f"peak RSS {max(r['peak_rss_mb'] for r in strm):,.0f} MB")
    print(f"exact global shuffle:     {ex['gb_s']:7.3f} GB/s delivered "
          f"({ex['tokens_s']:,.0f} tokens/s, {args.exact_steps} steps)   "
          f"ratio to sequential {ex['gb_s'] / seq_gb_s:.3f}   "
          f"peak RSS {ex['peak_rss_mb']:,.0f} MB")
    print(f"streaming / exact:        {med(r['gb_s'] for r in strm) / ex['gb_s']:.1f} x")
    print("mixing per batch (mean over the first batches):")
    for name, mix in (("streaming", s0["mixing"]), ("exact", ex["mixing"])):
        print(f"  {name:10s} " + ", ".join(f"{k} {v:,.1f}" for k, v in mix.items()))
    print(f"ratios (sequential s / stream s) per repeat: "
          + ", ".join(f"{a['seconds'] / b['seconds']:.3f}" for a, b in zip(seq, strm)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", help="a run directory (default: build synthetic ones)")
    ap.add_argument("--hook", help="hook to read (default: the first)")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--buffer-tokens", type=int, default=1 << 16)
    ap.add_argument("--block-rows", type=int, default=0, help="0: the layout's rows_per_shard")
    ap.add_argument("--exact-steps", type=int, default=8)
    ap.add_argument("--mix-batches", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=256, help="synthetic run: total rows")
    ap.add_argument("--seq-len", type=int, default=1024, help="synthetic run: tokens per row")
    ap.add_argument("--hidden", type=int, default=896, help="synthetic run: hidden size")
    ap.add_argument("--codec", action="append", choices=("none", "zstd", "blosc"),
                    help="synthetic run codec (repeatable; default: zstd and none)")
    ap.add_argument("--chunk-tokens", type=int, default=0,
                    help="synthetic run: tokens per inner activation chunk (0: whole row)")
    ap.add_argument("--measure", choices=("sequential", "stream", "exact"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        return measure(args)
    if args.run:
        return compare(args, args.run, args.run)

    from tests import reader_fixtures

    for codec in args.codec or ["zstd", "none"]:
        with tempfile.TemporaryDirectory(prefix="actx-bench-read-") as tmp:
            run_dir = os.path.join(tmp, "run")
            t0 = time.perf_counter()
            parts = max(1, args.rows // 64)
            reader_fixtures.build_run(
                run_dir, num_partitions=parts, partition_rows=64, rows_per_shard=8,
                chunk_rows=1, seq_len=args.seq_len, hidden=args.hidden,
                hooks=("layers.0.resid_post",), dtype="bfloat16",
                committed=tuple(range(parts)), arc_every=0, codec=codec,
                random_values=True, chunk_tokens=args.chunk_tokens)
            label = (f"{parts * 64} rows x {args.seq_len} x {args.hidden} bfloat16, codec "
                     f"{codec}, 8 rows per shard, inner chunk 1 row")
            print(f"built {label} in {time.perf_counter() - t0:.1f} s")
            compare(args, run_dir, label)


if __name__ == "__main__":
    main()

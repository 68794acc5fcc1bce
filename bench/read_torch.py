"""The PyTorch dataset (reader.torch_data) against `run.stream`, the same epochs, one run.

    python bench/read_torch.py                       # a synthetic bf16 store (zstd)
    python bench/read_torch.py --run ./runs/r1 --hook layers.12.resid_post
    python bench/read_torch.py --workers 2           # also a DataLoader with 2 workers

Prints, per round (rounds alternate, medians at the end, since other processes share the
cores): tokens/s of one epoch of `run.stream` (numpy batches in the stored dtype), of
`ActivationDataset` iterated in this process (float32 tensors: the stream plus the cast),
and the ratio dataset / stream (the issue's target: >= 0.8). With --workers, three
epochs through `dataset.loader(workers)` too, timed from its first batch (the spawned
workers' start, seconds of importing torch and tensorstore, is left out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from actx import reader  # noqa: E402
from actx.reader import torch_data  # noqa: E402


def _epoch(batches, touch) -> tuple[float, int]:
    t0, tokens = time.perf_counter(), 0
    for b in batches:
        tokens += touch(b)
    return time.perf_counter() - t0, tokens


def _after_first(batches, touch) -> tuple[float, int]:
    """Seconds and tokens from the first item on (worker start left out)."""
    it = iter(batches)
    next(it)
    t0, tokens = time.perf_counter(), 0
    for b in it:
        tokens += touch(b)
    return time.perf_counter() - t0, tokens


def compare(args: argparse.Namespace, run_dir: str) -> None:
    run = reader.open_run(run_dir)
    hook = args.hook or next(iter(run.hooks))
    common = dict(buffer_tokens=args.buffer_tokens, drop_last=False, seed=0)
    rates = {"stream": [], "dataset": [], "loader": []}
    for r in range(args.rounds):
        with run.stream(hook, args.batch_size, epochs=1, **common) as s:
            sec, n = _epoch(s, lambda b: len(b.acts[hook]))
        rates["stream"].append(n / sec)
        ds = torch_data.ActivationDataset(run, hook, args.batch_size, epochs=1, **common)
        sec, n2 = _epoch(ds, lambda x: x.shape[0])
        assert n2 == n, (n2, n)
        rates["dataset"].append(n2 / sec)
        line = (f"round {r}: stream {rates['stream'][-1] / 1e6:.2f} M tokens/s, dataset "
                f"{rates['dataset'][-1] / 1e6:.2f} M tokens/s "
                f"({rates['dataset'][-1] / rates['stream'][-1]:.2f} x)")
        if args.workers:
            # Three epochs, timed from the first batch: the spawned workers' start (their
            # imports) is left out, as a long training run amortises it.
            many = torch_data.ActivationDataset(run, hook, args.batch_size, epochs=3,
                                                **common)
            sec, n3 = _after_first(many.loader(args.workers), lambda x: x.shape[0])
            rates["loader"].append(n3 / sec)
            line += (f", loader x{args.workers} {rates['loader'][-1] / 1e6:.2f} M tokens/s "
                     f"(after its first batch)")
        print(line, flush=True)
    med = {k: statistics.median(v) for k, v in rates.items() if v}
    print(f"median over {args.rounds} rounds: dataset / stream = "
          f"{med['dataset'] / med['stream']:.2f} x ({n} tokens per epoch, batch "
          f"{args.batch_size}, torch {torch.__version__}, {os.cpu_count()} cores)")
    if "loader" in med:
        print(f"  loader with {args.workers} workers / stream = "
              f"{med['loader'] / med['stream']:.2f} x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", help="a run directory (default: build a synthetic one)")
    ap.add_argument("--hook")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--buffer-tokens", type=int, default=1 << 16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--rows", type=int, default=128, help="synthetic run: total rows")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=896)
    args = ap.parse_args(argv)
    if args.run:
        return compare(args, args.run)
    from tests import reader_fixtures

    with tempfile.TemporaryDirectory(prefix="actx-bench-torch-") as tmp:
        run_dir = os.path.join(tmp, "run")
        parts = max(1, args.rows // 64)
        reader_fixtures.build_run(
            run_dir, num_partitions=parts, partition_rows=64, rows_per_shard=8,
            seq_len=args.seq_len, hidden=args.hidden, hooks=("layers.0.resid_post",),
            dtype="bfloat16", committed=tuple(range(parts)), arc_every=0, codec="zstd",
            random_values=True)
        print(f"built {parts * 64} rows x {args.seq_len} x {args.hidden} bfloat16 (zstd)")
        compare(args, run_dir)


if __name__ == "__main__":
    main()

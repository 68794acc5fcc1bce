"""Extraction through the Beam transform against the worker target, one run, same machine.

Builds a random-init Qwen2 checkpoint and a prepared token store, then extracts every
partition of a fresh copy of it (1) with the worker target (`workers.loop.runner.Worker.run`,
what `actx extract` runs) and (2) through `adapters.beam_extract.ExtractPartitions` on
Beam's in-process FnApiRunner, both in this process and both whole jobs (model load,
compile, every partition committed). Rounds alternate; it prints tokens/s of each and the
ratio of the medians.

  python bench/extract_beam.py                 # CPU default, a few minutes
  python bench/extract_beam.py --qwen05b       # Qwen2.5-0.5B shapes, bf16, for a GPU
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def _parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_model_args(p, batch=8)
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--steps-per-partition", type=int, default=4)
    p.add_argument("--hooked-layers", type=int, default=4, help="resid_post of the last N")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="working directory (default: a temp dir)")
    return common.apply_presets(p.parse_args())


def main() -> None:
    args = _parse_args()
    import jax

    from actx.adapters import beam_extract
    from bench.extract import _write_checkpoint
    from actx.schemas import commit as commit_lib
    from actx.schemas import store as store_lib
    from tests import token_runs, worker_procs
    from actx.schemas import worker_options
    from actx.workers.loop import runner

    work = args.dir or tempfile.mkdtemp(prefix="actx-bench-beam-")
    model_dir = _write_checkpoint(args, os.path.join(work, "model"))
    hooks = ",".join(f"layers.{i}.resid_post"
                     for i in range(args.layers - args.hooked_layers, args.layers))
    rows_per_partition = args.batch * args.steps_per_partition
    n_rows = rows_per_partition * args.partitions
    source = os.path.join(work, "source")
    token_runs.write_token_run(
        source, model_dir, n_rows=n_rows, seq_len=args.seq, vocab=args.vocab, hooks=hooks,
        dtype="bfloat16", model_dtype=args.dtype,
        rows_per_shard=min(rows_per_partition, max(1, args.batch // 2)),
        partition_rows=rows_per_partition, codec="none")
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}; model hidden "
          f"{args.hidden}, {args.layers} layers; batch {args.batch} x seq {args.seq}; "
          f"{args.partitions} partitions of {rows_per_partition} rows; hooks {hooks}")
    tokens = n_rows * args.seq

    def fresh(name: str) -> str:
        path = os.path.join(work, name)
        shutil.rmtree(path, ignore_errors=True)
        return worker_procs.copy_token_store(source, path)

    def workers_job() -> float:
        run = fresh("workers")
        start = time.perf_counter()
        code = runner.Worker(worker_options.WorkerOptions(run=run, batch_size=args.batch,
                                                  heartbeat_s=5.0)).run()
        elapsed = time.perf_counter() - start
        assert code == 0
        return elapsed

    def beam_job() -> float:
        run = fresh("beam")
        opts = worker_options.WorkerOptions(run=run, batch_size=args.batch, heartbeat_s=5.0)
        start = time.perf_counter()
        beam_extract.run_extract(opts, run, "bench", ["--runner=FnApiRunner"])
        elapsed = time.perf_counter() - start
        done = commit_lib.committed_partitions(store_lib.open_store(run))
        assert len(done) == args.partitions, done
        return elapsed

    times = {"workers": [], "beam": []}
    for r in range(args.rounds):
        for name, job in (("workers", workers_job), ("beam", beam_job)):
            times[name].append(job())
            print(f"round {r + 1}: {name:8s} {tokens / times[name][-1]:10,.0f} tokens/s "
                  f"({times[name][-1]:.2f} s)", flush=True)
    w, b = (statistics.median(times[k]) for k in ("workers", "beam"))
    print(f"worker target (Worker.run), whole job:     {tokens / w:12,.0f} tokens/s "
          f"(median of {args.rounds}, {w:.2f} s)")
    print(f"Beam transform (FnApiRunner), whole job:   {tokens / b:12,.0f} tokens/s "
          f"(median of {args.rounds}, {b:.2f} s)")
    print(f"ratio Beam / worker target:                {w / b:12.3f}")


if __name__ == "__main__":
    main()

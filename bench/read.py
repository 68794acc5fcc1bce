"""Shuffled reading against the sequential decoded read of the same store, in one run.

    python bench/read.py                          # synthetic bf16 runs, zstd and no codec
    python bench/read.py --codec none --rows 512  # one codec, a bigger store
    python bench/read.py --run ./runs/r1 --hook layers.12.resid_post
    python bench/read.py --codec none --also-decoded  # mapped vs decoded, same rounds
    python bench/read.py --also-numpy-copy        # the C copy vs numpy's, same rounds
    python bench/read.py --float8                 # float8 vs bfloat16 streams, same rounds
    python bench/read.py --float8 --cold          # the same, each epoch read from the disk

For each store it prints: (1) the sequential decoded read (every block of the hook read
through tensorstore in row order, 2 and 4 reads in flight, the faster counting, decoded
to numpy, padding included; local files read the way the stream reads them,
--file-io-mode, by default mapped), as `array[lo:hi].read()` and, stricter, decoded into
one reused buffer as the stream decodes; (2) the streaming shuffle (`run.stream`) over
whole epochs: the same blocks read and decoded (or, for a local store without a codec,
mapped and copied straight into batches; --no-map-shards decodes them), plus the
permutation and the batch copies (reader.storage.row_copy's C kernel where it builds here;
--no-native-copy: numpy's gather); its ratios are (1)'s times over (2)'s for the same
bytes, overall and per round;
(3) the exact global shuffle (`run.batches`, straight from the arrays) over a few steps;
the CPU seconds and peak RSS of each (each runs in its own process, so the figure is its
own); the load average; and how mixed the batches are (reader.streaming.mixing: distinct documents,
partitions and blocks per batch) for (2) and (3). Each child times --passes passes after
an untimed one (thread pools, allocator), children alternate over --rounds, and medians
are printed, because other processes share the cores. The files were just written or
read, so reads come from the page cache: the figures are decode and copy speed, not disk
speed; with --cold (the streams only) every file of the run is dropped from the page cache
(fsync, then posix_fadvise DONTNEED) before each epoch, which then reads from the disk
through a stream of its own.
"""

from __future__ import annotations

import argparse
import functools
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
import tensorstore as ts  # noqa: E402

from actx import reader  # noqa: E402
from actx.reader.streaming import mixing  # noqa: E402
from actx.reader.storage import read_contexts as contexts_lib  # noqa: E402
from actx.schemas import layout  # noqa: E402


def _peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM, not ru_maxrss: ru_maxrss survives
    exec, so a child would report the parent's peak (the synthetic store it built)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: KiB


# Block reads in flight for the sequential read; the faster is the baseline.
SEQUENTIAL_IN_FLIGHT = (2, 4)


def sequential(run: reader.Run, hook: str, block_rows: int, passes: int,
               file_io_mode: str | None = None) -> dict:
    """Decoded bytes/s of reading every committed block in row order, two ways, each
    with 2 and with 4 blocks in flight (keys "read@2", "into_buffer@4", ...):
    "read": `array[lo:hi].read()`, a new numpy array per block (the plain way to read);
    "into_buffer": decoded into one reused buffer (what the stream does for its reads, so
    no allocation or page faults: the stricter baseline).
    One untimed pass of each first (thread pools, allocator), then `passes` timed ones."""
    # The context the stream reads in (no chunk cache), so both read the same way.
    array = run.open_array(layout.activation_array_key(hook),
                           contexts_lib.read_contexts(file_io_mode=file_io_mode)[0])
    blocks = [(lo, min(lo + block_rows, p.row_stop)) for p in run.committed_partitions
              for lo in range(p.row_start, p.row_stop, block_rows)]
    out = {}
    for in_flight in SEQUENTIAL_IN_FLIGHT:
        out.update(_sequential_passes(array, blocks, block_rows, passes, in_flight))
    return out


def _sequential_passes(array: ts.TensorStore, blocks: list, block_rows: int, passes: int,
                       in_flight: int) -> dict:
    buffer = np.empty((in_flight * block_rows,) + tuple(array.shape[1:]),
                      array.dtype.numpy_dtype)
    target = ts.array(buffer, copy=False, write=True)

    def read_pass() -> int:
        futures, nbytes = [], 0
        for lo, hi in blocks:
            futures.append(array[lo:hi].read())
            if len(futures) >= in_flight:
                nbytes += futures.pop(0).result().nbytes
        return nbytes + sum(f.result().nbytes for f in futures)

    def into_buffer_pass() -> int:
        futures, nbytes = [], 0
        for i, (lo, hi) in enumerate(blocks):
            at = (i % in_flight) * block_rows
            if len(futures) >= in_flight:  # the read that used this part of the buffer
                futures.pop(0).result()
            futures.append(target[at:at + hi - lo].write(array[lo:hi]))
            nbytes += (hi - lo) * buffer[0].nbytes
        for f in futures:
            f.result()
        return nbytes

    out = {}
    for name, one_pass in (("read", read_pass), ("into_buffer", into_buffer_pass)):
        seconds, cpu = [], []
        for _ in range(passes + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            nbytes = one_pass()
            seconds.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        key = f"{name}@{in_flight}"
        out[key], out[key + "_cpu"] = seconds[1:], cpu[1:]
    out["decoded_bytes"] = nbytes
    return out


def drop_from_page_cache(run_dir: str) -> int:
    """Every file under run_dir out of the page cache (written back first: only clean
    pages are dropped), so that the next read of it comes from the disk. Returns bytes."""
    total = 0
    for root, _, names in os.walk(run_dir):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def stream_cold(run: reader.Run, run_dir: str, hook: str, batch_size: int,
                buffer_tokens: int, block_rows: int, passes: int, prefetch_buffers: int,
                file_io_mode: str | None = None, framework: str = "numpy",
                **stream_args) -> dict:
    """`stream`'s figures with each epoch read from the disk: the run's files dropped
    from the page cache, then a stream of one epoch (one stream for all would read the
    next epoch's first buffer ahead, from the cache); one untimed epoch first."""
    seconds, cpu = [], []
    for _ in range(passes + 1):
        drop_from_page_cache(run_dir)
        t0, c0 = time.perf_counter(), time.process_time()
        out = stream(run, hook, batch_size, buffer_tokens, block_rows, 0, prefetch_buffers,
                     file_io_mode, framework, **stream_args)
        seconds.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    out.update(seconds=seconds[1:], cpu=cpu[1:], cold=True)
    return out


def stream(run: reader.Run, hook: str, batch_size: int, buffer_tokens: int,
           block_rows: int, passes: int, prefetch_buffers: int,
           file_io_mode: str | None = None, framework: str = "numpy",
           **stream_args) -> dict:
    """Whole epochs of the streaming shuffle (drop_last=False: every valid token once),
    one untimed epoch first, then `passes` timed ones. framework="jax": every batch is
    handed over as a JAX array on the default device and waited for (device-ready).
    passes=0: the one epoch, timed (stream_cold's)."""
    t0 = time.perf_counter()
    s = run.stream(hook, batch_size, buffer_tokens=buffer_tokens, block_rows=block_rows,
                   seed=0, drop_last=False, epochs=passes + 1,
                   prefetch_buffers=prefetch_buffers, file_io_mode=file_io_mode,
                   framework=framework, **stream_args)
    batch_dtype = ""
    setup_s = time.perf_counter() - t0
    seconds, cpu, tokens, nbytes = [], [], 0, 0
    device = "host"
    with s:
        t0, c0 = time.perf_counter(), time.process_time()
        for b in s:
            if framework == "jax":
                b.acts[hook].block_until_ready()  # the batch is on the device
                if b.step == 0:
                    device = str(next(iter(b.acts[hook].devices())))
            if b.step % s.steps_per_epoch == 0 and b.step:  # an epoch ended
                seconds.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                t0, c0 = time.perf_counter(), time.process_time()
            if b.epoch == min(1, passes):  # a timed epoch's tokens
                tokens, nbytes = tokens + len(b), nbytes + b.acts[hook].nbytes
                batch_dtype = str(b.acts[hook].dtype)
        seconds.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    table = s.plan.table
    itemsize = np.dtype(run.activation_array(hook).dtype.numpy_dtype).itemsize
    decoded = int((table.row_stop - table.row_start).sum()) * run.seq_len * \
        run.hook(hook).hidden * itemsize
    timed = slice(1, None) if passes else slice(None)
    return {"seconds": seconds[timed], "cpu": cpu[timed], "setup_s": setup_s, "tokens": tokens,
            "delivered_bytes": nbytes, "decoded_bytes": decoded,
            "blocks_per_buffer": s.blocks_per_buffer, "gather_threads": s.gather_threads,
            "reads_in_flight": s.reads_in_flight, "read_path": s.read_paths[hook],
            "copy_path": s.copy_path, "batch_dtype": batch_dtype,
            "stored_bytes": _stored_bytes(run, hook),
            "framework": framework, "device": device,
            # every epoch alike, the untimed one included
            "producer": {k: v / (passes + 1) for k, v in s.producer_seconds.items()}}


def _stored_bytes(run: reader.Run, hook: str) -> int:
    """Bytes on disk of a local hook's arrays (a float8 hook's scales included)."""
    names = [hook] + ([f"{hook}.scale"] if run.hook(hook).quantised else [])
    total = 0
    for name in names:
        folder = run.location.join(run.stored_key(layout.activation_array_key(name))).path
        for root, _, files in os.walk(folder):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def stream_mixing(run: reader.Run, hook: str, batch_size: int, buffer_tokens: int,
                  block_rows: int, mix_batches: int) -> dict:
    """Mixing of the first batches for buffers of 1/4, 1 and 4 x buffer_tokens, with
    blocks of block_rows and of one inner chunk's rows (its own process: no timing)."""
    table = []
    chunk_rows = run.spec.layout.chunk_rows
    for rows in dict.fromkeys((block_rows, chunk_rows)):
        for tokens in (buffer_tokens // 4, buffer_tokens, buffer_tokens * 4):
            if tokens < rows * run.seq_len:
                continue
            with run.stream(hook, batch_size, buffer_tokens=tokens, block_rows=rows,
                            seed=0) as s:
                mix = mixing.measure(run, (b for _, b in zip(range(mix_batches), s)),
                                     block_rows=block_rows)
            table.append({"buffer_tokens": tokens, "block_rows": rows, **mix.as_dict()})
    return {"table": table}


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
    # Both read local files the way the stream does by default, unless told otherwise.
    file_io_mode = args.file_io_mode or contexts_lib.default_file_io_mode(run)
    if args.measure == "sequential":
        out = sequential(run, hook, block_rows, args.passes, file_io_mode=file_io_mode)
    elif args.measure == "stream":
        measure_stream = (functools.partial(stream_cold, run, args.run) if args.cold
                          else functools.partial(stream, run))
        out = measure_stream(hook, args.batch_size, args.buffer_tokens, block_rows,
                             args.passes, args.prefetch_buffers, file_io_mode,
                             framework=args.framework, gather_threads=args.gather_threads,
                             reads_in_flight=args.reads_in_flight,
                             map_shards=not args.no_map_shards,
                             native_copy=not args.no_native_copy, dtype=args.output_dtype)
    elif args.measure == "mixing":
        out = stream_mixing(run, hook, args.batch_size, args.buffer_tokens, block_rows,
                            args.mix_batches)
    else:
        out = exact(run, hook, args.batch_size, args.exact_steps, block_rows,
                    args.mix_batches)
    out["peak_rss_mb"] = _peak_rss_mb()
    out["file_io_mode"] = file_io_mode or "tensorstore's default"
    print(json.dumps(out))


def _child(args: argparse.Namespace, mode: str, run_dir: str, flags: tuple = ()) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", mode, "--run", run_dir,
           "--batch-size", str(args.batch_size), "--buffer-tokens", str(args.buffer_tokens),
           "--exact-steps", str(args.exact_steps), "--mix-batches", str(args.mix_batches),
           "--passes", str(args.passes), "--prefetch-buffers", str(args.prefetch_buffers),
           "--framework", args.framework]
    if args.hook:
        cmd += ["--hook", args.hook]
    if args.file_io_mode:
        cmd += ["--file-io-mode", args.file_io_mode]
    for flag, value in (("--gather-threads", args.gather_threads),
                        ("--reads-in-flight", args.reads_in_flight)):
        if value:
            cmd += [flag, str(value)]
    if args.block_rows:
        cmd += ["--block-rows", str(args.block_rows)]
    if args.cold and mode == "stream":
        cmd += ["--cold"]
    for flag in ("--no-map-shards", "--no-native-copy"):
        if getattr(args, flag[2:].replace("-", "_")) or flag in flags:
            cmd += [flag]
    if "--output-dtype" in flags:
        cmd += list(flags[flags.index("--output-dtype"):][:2])
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(args: argparse.Namespace, run_dir: str, label: str) -> None:
    """Alternates the modes in child processes over --rounds; prints medians."""
    # Other ways of streaming, timed in the same rounds: (label, flags, results).
    others = [(way, (flag,), []) for wanted, way, flag in (
        (args.also_decoded, "decoding every block instead", "--no-map-shards"),
        (args.also_numpy_copy, "copying with numpy's gather instead", "--no-native-copy"))
        if wanted]
    seq, strm = [], []
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        seq.append(_child(args, "sequential", run_dir))
        strm.append(_child(args, "stream", run_dir))
        for _, flags, results in others:
            results.append(_child(args, "stream", run_dir, flags))
    load_after = os.getloadavg()
    ex = _child(args, "exact", run_dir)
    mix = _child(args, "mixing", run_dir)
    med = statistics.median

    def passes(kind: str, in_flight: int, suffix: str = "") -> list[float]:
        return [x for r in seq for x in r[f"{kind}@{in_flight}{suffix}"]]

    # The baseline of each kind is its faster setting (the stricter comparison).
    fastest = {kind: min(SEQUENTIAL_IN_FLIGHT, key=lambda n: med(passes(kind, n)))
               for kind in ("read", "into_buffer")}
    seq_s, buf_s = (passes(kind, fastest[kind]) for kind in ("read", "into_buffer"))
    strm_s = [x for r in strm for x in r["seconds"]]
    decoded = seq[0]["decoded_bytes"]
    seq_gb_s = decoded / med(seq_s) / 1e9
    s0 = strm[0]
    strm_gb_s = s0["delivered_bytes"] / med(strm_s) / 1e9
    print(f"\n== {label}: batch {args.batch_size} tokens, buffer {args.buffer_tokens} tokens "
          f"({s0['blocks_per_buffer']} blocks, prefetch_buffers {args.prefetch_buffers}, "
          f"reads_in_flight {s0['reads_in_flight']}, gather_threads {s0['gather_threads']}, "
          f"read path {s0['read_path']}; copy {s0['copy_path']}); "
          f"file_io_mode {s0['file_io_mode']} for both; "
          f"stream batches as {s0['framework']} on {s0['device']}; "
          f"medians of {len(seq_s)} timed passes each")
    print(f"sequential decoded read:  {seq_gb_s:7.3f} GB/s decoded "
          f"({decoded / 1e9:.3f} GB in {med(seq_s):.2f} s; array.read() per block, "
          f"{fastest['read']} in flight)   "
          f"peak RSS {max(r['peak_rss_mb'] for r in seq):,.0f} MB")
    print(f"  into a reused buffer:   {decoded / med(buf_s) / 1e9:7.3f} GB/s decoded "
          f"({med(buf_s):.2f} s, {fastest['into_buffer']} in flight)")
    print("  each setting, median s: " + ", ".join(
        f"{kind} {n} in flight {med(passes(kind, n)):.3f}"
        for kind in ("read", "into_buffer") for n in SEQUENTIAL_IN_FLIGHT))
    print(f"streaming shuffle:        {strm_gb_s:7.3f} GB/s delivered, "
          f"{s0['decoded_bytes'] / med(strm_s) / 1e9:.3f} GB/s decoded "
          f"({s0['tokens'] / med(strm_s):,.0f} tokens/s, {med(strm_s):.2f} s/epoch)   "
          f"peak RSS {max(r['peak_rss_mb'] for r in strm):,.0f} MB")
    print(f"  ratio (same bytes decoded) to the sequential read {med(seq_s) / med(strm_s):.3f}, "
          f"to the reused-buffer read {med(buf_s) / med(strm_s):.3f}")
    # Each round's sequential and streaming children ran back to back, so a round's ratio
    # saw about the same load; their spread says how much one run can be trusted.
    per_round = [(med(a[f"read@{fastest['read']}"]) / med(b["seconds"]),
                  med(a[f"into_buffer@{fastest['into_buffer']}"]) / med(b["seconds"]))
                 for a, b in zip(seq, strm)]
    print("  per round, to the sequential read / the reused-buffer read: " + ", ".join(
        f"{x:.2f} / {y:.2f}" for x, y in per_round))
    cpu = {k: med(passes(k, fastest[k], "_cpu")) for k in ("read", "into_buffer")}
    cpu["stream"] = med([x for r in strm for x in r["cpu"]])
    prod = {k: med([r["producer"][k] for r in strm]) for k in strm[0]["producer"]}
    print(f"  the thread cutting batches, s per epoch: busy {prod['busy']:.3f}, of which "
          f"waiting for reads {prod['read_wait']:.3f} and for the copies "
          f"({s0['gather_threads']} threads) {prod['copy_wait']:.3f}")
    print(f"  CPU s per pass (all threads; less sensitive to other jobs than wall time): "
          f"sequential read {cpu['read']:.2f}, reused buffer {cpu['into_buffer']:.2f}, "
          f"stream epoch {cpu['stream']:.2f}")
    for way, _, results in others:  # the same stream another way, in the same rounds
        other_s = [x for r in results for x in r["seconds"]]
        read_key = f"read@{fastest['read']}"
        rounds = ", ".join(f"{med(a[read_key]) / med(b['seconds']):.2f}"
                           for a, b in zip(seq, results))
        print(f"  {way} ({results[0]['read_path']}; copy {results[0]['copy_path']}): "
              f"{med(other_s):.2f} s/epoch, ratio to the sequential read "
              f"{med(seq_s) / med(other_s):.3f}, per round {rounds}; CPU s per epoch "
              f"{med([x for r in results for x in r['cpu']]):.2f}, peak RSS "
              f"{max(r['peak_rss_mb'] for r in results):,.0f} MB")
    print(f"  load average (1 min) before / after the timed rounds: {load_before[0]:.2f} / "
          f"{load_after[0]:.2f} on {os.cpu_count()} cores")
    print(f"exact global shuffle:     {ex['gb_s']:7.3f} GB/s delivered "
          f"({ex['tokens_s']:,.0f} tokens/s, {args.exact_steps} steps)   "
          f"ratio to sequential {ex['gb_s'] / seq_gb_s:.3f}   "
          f"peak RSS {ex['peak_rss_mb']:,.0f} MB")
    print(f"streaming / exact:        {strm_gb_s / ex['gb_s']:.1f} x")
    print(f"mixing: distinct per batch of {args.batch_size} tokens, mean over the first "
          f"{args.mix_batches} batches (blocks counted in the default block size)")
    print(f"  {'':34s} {'documents':>10s} {'partitions':>10s} {'blocks':>8s} {'rows':>8s}")
    rows = [("exact global shuffle", ex["mixing"])] + [
        (f"stream buffer {m['buffer_tokens']:>8,d}, blocks of {m['block_rows']}", m)
        for m in mix["table"]]
    for name, m in rows:
        print(f"  {name:34s} {m['documents']:10,.1f} {m['partitions']:10,.1f} "
              f"{m['blocks']:8,.1f} {m['rows']:8,.1f}")
    for name, xs in (("sequential read", seq_s), ("reused buffer", buf_s),
                     ("streaming epoch", strm_s)):
        print(f"  timed passes, {name} s: " + ", ".join(f"{x:.2f}" for x in xs))


def compare_dtypes(args: argparse.Namespace, runs: dict[str, str], label: str) -> dict:
    """The streaming shuffle of the same values stored as bfloat16 and as float8 (with
    per-token scales, handed over dequantised as float32 or bfloat16), children alternating
    over --rounds: tokens/s of each and their ratio, on the same disk in the same window.
    Returns {dtype: median s per epoch}."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    results: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name, run_dir in runs.items():
            out = _child(args, "stream", run_dir, dtype_flags(name))
            seconds[name] += out["seconds"]
            results[name] = out
    med = statistics.median
    where = ("each epoch from the disk (page cache dropped before it)" if args.cold
             else "from the page cache")
    print(f"\n== {label}: streaming shuffle, batch {args.batch_size} tokens, buffer "
          f"{args.buffer_tokens} tokens, {where}; medians of "
          f"{len(seconds[next(iter(runs))])} epochs each, alternating")
    base = med(seconds["bfloat16"])
    for name, xs in seconds.items():
        r = results[name]
        print(f"  {name:28s} {r['tokens'] / med(xs):12,.0f} tokens/s  ({med(xs):.3f} s/epoch; "
              f"stored {r['stored_bytes'] / 1e6:,.1f} MB of activations; handed over as "
              f"{r['batch_dtype']}; read path {r['read_path']})  "
              f"x{base / med(xs):.2f} of bfloat16")
    return {name: med(xs) for name, xs in seconds.items()}


def dtype_flags(name: str) -> tuple:
    """The stream's output dtype for a compare_dtypes entry ("float8_e4m3 as bfloat16")."""
    return ("--output-dtype", name.split(" as ")[1]) if " as " in name else ()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", help="a run directory (default: build synthetic ones)")
    ap.add_argument("--hook", help="hook to read (default: the first)")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--buffer-tokens", type=int, default=1 << 16)
    ap.add_argument("--block-rows", type=int, default=0, help="0: the layout's rows_per_shard")
    ap.add_argument("--prefetch-buffers", type=int, default=1,
                    help="stream buffers read ahead while one is cut into batches")
    ap.add_argument("--file-io-mode", choices=contexts_lib.FILE_IO_MODES,
                    help="how both the sequential read and the stream read local files "
                         "(default: the stream's default, memmap where tensorstore has it)")
    ap.add_argument("--gather-threads", type=int, help="stream: threads copying into batches")
    ap.add_argument("--reads-in-flight", type=int, help="stream: block reads decoding at once")
    ap.add_argument("--also-decoded", action="store_true",
                    help="time the stream a second way in each round, every block decoded "
                         "(--no-map-shards), for a comparison in the same window")
    ap.add_argument("--also-numpy-copy", action="store_true",
                    help="time the stream a second way in each round, copying into batches "
                         "with numpy's gather (--no-native-copy), for a comparison in the "
                         "same window")
    ap.add_argument("--no-native-copy", action="store_true",
                    help="stream: copy into batches with numpy's gather, not reader.storage.row_copy's "
                         "C kernel")
    ap.add_argument("--no-map-shards", action="store_true",
                    help="stream: decode every hook with tensorstore, even where its shard "
                         "files could be mapped (codec none, local)")
    ap.add_argument("--framework", choices=("numpy", "jax"), default="numpy",
                    help="stream: hand batches over as numpy or as JAX arrays on the default "
                         "device (waited for), e.g. a GPU's memory")
    ap.add_argument("--exact-steps", type=int, default=8)
    ap.add_argument("--mix-batches", type=int, default=16)
    ap.add_argument("--passes", type=int, default=3, help="timed passes per child process")
    ap.add_argument("--rounds", type=int, default=2,
                    help="child processes per mode, alternating sequential and streaming")
    ap.add_argument("--rows", type=int, default=256, help="synthetic run: total rows")
    ap.add_argument("--seq-len", type=int, default=1024, help="synthetic run: tokens per row")
    ap.add_argument("--hidden", type=int, default=896, help="synthetic run: hidden size")
    ap.add_argument("--codec", action="append", choices=("none", "zstd", "blosc"),
                    help="synthetic run codec (repeatable; default: zstd and none)")
    ap.add_argument("--chunk-tokens", type=int, default=0,
                    help="synthetic run: tokens per inner activation chunk (0: whole row)")
    ap.add_argument("--float8", action="store_true",
                    help="synthetic runs of the same values as bfloat16 and as float8_e4m3 "
                         "(per-token scales): the streaming shuffle's tokens/s of each, side "
                         "by side in the same rounds")
    ap.add_argument("--cold", action="store_true",
                    help="streams read each epoch from the disk: the run's files dropped "
                         "from the page cache before it")
    ap.add_argument("--output-dtype", help=argparse.SUPPRESS)
    ap.add_argument("--measure", choices=("sequential", "stream", "exact", "mixing"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        return measure(args)
    if args.run:
        return compare(args, args.run, args.run)

    from tests import reader_fixtures

    if args.float8:
        for codec in args.codec or ["zstd", "none"]:
            with tempfile.TemporaryDirectory(prefix="actx-bench-read-") as tmp:
                runs = {}
                parts = max(1, args.rows // 64)
                for dtype in ("bfloat16", "float8_e4m3"):
                    runs[dtype] = os.path.join(tmp, dtype)
                    reader_fixtures.build_run(
                        runs[dtype], num_partitions=parts, partition_rows=64,
                        rows_per_shard=8, chunk_rows=1, seq_len=args.seq_len,
                        hidden=args.hidden, hooks=("layers.0.resid_post",), dtype=dtype,
                        committed=tuple(range(parts)), arc_every=0, codec=codec,
                        random_values=True, chunk_tokens=args.chunk_tokens)
                runs["float8_e4m3 as bfloat16"] = runs["float8_e4m3"]
                compare_dtypes(args, runs, f"{parts * 64} rows x {args.seq_len} x "
                                           f"{args.hidden}, codec {codec}")
        return

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

"""Throughput and peak memory of prepare vs plain batched `tokenizers` encoding.

One run: for 1x and 4x the input (a FineWeb-schema parquet of --docs and 4 * --docs
documents of about 670 tokens, FineWeb's mean, each joining --texts-per-doc synthetic
texts; row groups of 1000 rows), encodes its texts with `Tokenizer.encode_batch` in a
fresh process, prepares it with Beam's in-process runner (or the Beam flags after --) in
another, and encodes the texts again (the machine may be shared: the plain figure is the
mean of the runs before and after). Prints tokens/s of both, their ratio, and each
process's peak RSS (sampled, with its children's: the multi-process runner's workers).
The pipeline encodes text with `encode_batch_fast` (the same ids, no character offsets),
so the plain `encode_batch_fast` loop is timed the same way and printed beside: the
stricter baseline, the pipeline's own overhead alone.
Example:
  python bench/prepare.py --docs 20000 --unit-bytes 4000000
  python bench/prepare.py --docs 20000 -- --direct_num_workers=2 \
      --direct_running_mode=multi_processing
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actx.pipeline import qwen_tokenizer, sample_data, units  # noqa: E402

ENCODE_BATCH = 512


def _make_parquet(path: str, n_docs: int, texts_per_doc: int) -> str:
    """FineWeb's schema, each text joining `texts_per_doc` synthetic ones."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = sample_data.make_fineweb_rows(n_docs, 0)
    extra = sample_data.make_fineweb_rows(n_docs * (texts_per_doc - 1), 1)
    for i, row in enumerate(rows):
        row["text"] = " ".join([row["text"]] + [r["text"] for r in extra[
            i * (texts_per_doc - 1):(i + 1) * (texts_per_doc - 1)]])
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=1000)
    return path


def _rss_mb(pid: int) -> float:
    """Resident MB of `pid` and all its descendants (the multi-process runner's workers)."""
    total = 0.0
    try:
        with open(f"/proc/{pid}/statm") as f:
            total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                total += sum(_rss_mb(int(c)) for c in f.read().split())
    except (FileNotFoundError, ProcessLookupError):
        pass
    return total


class _PeakRss:
    """Samples this process tree's RSS every 0.1 s. Not ru_maxrss: a child started by
    fork + exec inherits its parent's high-water mark there."""

    def __init__(self):
        self.peak_mb, self.stop = 0.0, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stop.is_set():
            self.peak_mb = max(self.peak_mb, _rss_mb(os.getpid()))
            self.stop.wait(0.1)

    def done(self) -> float:
        self.stop.set()
        self.thread.join()
        return max(self.peak_mb, _rss_mb(os.getpid()))


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (steadier than wall time on
    a shared machine)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _child_prepare(args) -> dict:
    from actx.pipeline import main as prepare_main
    from actx.schemas import runspec as R

    spec = R.RunSpec(R.ModelSpec(""), R.TokenizerSpec(args.tokenizer),
                     (R.SourceSpec("fineweb", (args.parquet,)),),
                     packing=R.PackingSpec(args.mode, args.seq_len),
                     layout=R.LayoutSpec(rows_per_shard=8, partition_rows=64))
    rss, started, cpu = _PeakRss(), time.perf_counter(), _cpu_s()
    manifest = prepare_main.run_prepare(spec, args.run, args.pipeline_args,
                                        unit_bytes=args.unit_bytes)
    return {"tokens": manifest.total_tokens, "seconds": time.perf_counter() - started,
            "cpu_s": _cpu_s() - cpu, "peak_rss_mb": rss.done()}


def _child_plain(args) -> dict:
    """The same texts, read as the pipeline reads them (row group by row group), encoded
    in batches in this one process: the speed the tokenizer allows here."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    rss = _PeakRss()
    tok = Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json"))
    encode = getattr(tok, args.plain_method)
    started, cpu = time.perf_counter(), _cpu_s()
    n = 0
    for batch in pq.ParquetFile(args.parquet).iter_batches(batch_size=ENCODE_BATCH,
                                                           columns=["text"]):
        texts = batch.column(0).to_pylist()
        n += sum(len(e.ids) for e in encode(texts, add_special_tokens=False))
    return {"tokens": n, "seconds": time.perf_counter() - started, "cpu_s": _cpu_s() - cpu,
            "peak_rss_mb": rss.done()}


def _run_child(kind: str, args, method: str = "encode_batch", **paths) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind,
           "--tokenizer", args.tokenizer, "--mode", args.mode, "--seq-len", str(args.seq_len),
           "--unit-bytes", str(args.unit_bytes), "--plain-method", method]
    for k, v in paths.items():
        cmd += [f"--{k}", v]
    out = subprocess.run(cmd + ["--", *args.pipeline_args], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mean(before: dict, after: dict) -> dict:
    return {"tokens": before["tokens"], "seconds": (before["seconds"] + after["seconds"]) / 2,
            "cpu_s": (before["cpu_s"] + after["cpu_s"]) / 2,
            "peak_rss_mb": max(before["peak_rss_mb"], after["peak_rss_mb"])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=10000, help="documents at 1x")
    parser.add_argument("--texts-per-doc", type=int, default=8,
                        help="synthetic texts joined into one document (8: ~670 tokens)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--mode", default="segmented")
    parser.add_argument("--unit-bytes", type=int, default=units.DEFAULT_UNIT_BYTES)
    parser.add_argument("--tokenizer", default=None, help="default: the converted Qwen2.5")
    parser.add_argument("--child", choices=["prepare", "plain"], help=argparse.SUPPRESS)
    parser.add_argument("--plain-method", default="encode_batch", help=argparse.SUPPRESS)
    parser.add_argument("--parquet", help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("pipeline_args", nargs="*", help="Beam flags, after --")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    args.tokenizer = args.tokenizer or qwen_tokenizer.ensure_qwen_tokenizer()
    if args.child:
        result = (_child_prepare if args.child == "prepare" else _child_plain)(args)
        print(json.dumps(result))
        return
    print(f"mode={args.mode} seq_len={args.seq_len} unit_bytes={args.unit_bytes} "
          f"cpus={os.cpu_count()} beam_args={args.pipeline_args or '[]'} load average "
          f"{os.getloadavg()[0]:.1f}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="actx-bench-") as tmp:
        for scale in (1, 4):
            parquet = _make_parquet(os.path.join(tmp, f"fw-{scale}x.parquet"),
                                    args.docs * scale, args.texts_per_doc)
            size_mb = os.path.getsize(parquet) / 1e6
            # Symmetric order (plain, fast, pipeline, fast, plain): a trend in the machine's
            # load moves both baselines alike.
            before = _run_child("plain", args, parquet=parquet)
            fast_before = _run_child("plain", args, "encode_batch_fast", parquet=parquet)
            pipe = _run_child("prepare", args, parquet=parquet,
                              run=os.path.join(tmp, f"run-{scale}x"))
            fast_after = _run_child("plain", args, "encode_batch_fast", parquet=parquet)
            after = _run_child("plain", args, parquet=parquet)
            plain, fast = _mean(before, after), _mean(fast_before, fast_after)
            for name, ref in (("plain", plain), ("plain fast", fast)):
                if pipe["tokens"] != ref["tokens"]:
                    raise SystemExit(f"token counts differ: pipeline {pipe['tokens']}, {name} "
                                     f"{ref['tokens']}")
            results[scale] = (pipe, plain)
            p_tps, t_tps = pipe["tokens"] / pipe["seconds"], plain["tokens"] / plain["seconds"]
            f_tps = fast["tokens"] / fast["seconds"]
            print(f"{scale}x: {args.docs * scale} docs, {pipe['tokens']:,} tokens, parquet "
                  f"{size_mb:.1f} MB; load average {os.getloadavg()[0]:.1f}")
            print(f"  pipeline (end to end, incl. startup and writes): {pipe['seconds']:.2f}s, "
                  f"{p_tps:,.0f} tokens/s, peak RSS {pipe['peak_rss_mb']:,.0f} MB")
            print(f"  plain tokenizers encode_batch (one process):     {plain['seconds']:.2f}s, "
                  f"{t_tps:,.0f} tokens/s (before {before['seconds']:.2f}s, after "
                  f"{after['seconds']:.2f}s), peak RSS {plain['peak_rss_mb']:,.0f} MB")
            print(f"  plain encode_batch_fast (one process):           {fast['seconds']:.2f}s, "
                  f"{f_tps:,.0f} tokens/s (before {fast_before['seconds']:.2f}s, after "
                  f"{fast_after['seconds']:.2f}s)")
            print(f"  ratio pipeline/plain: {p_tps / t_tps:.3f} (CPU seconds: pipeline "
                  f"{pipe['cpu_s']:.1f}, plain {plain['cpu_s']:.1f}, ratio "
                  f"{plain['cpu_s'] / pipe['cpu_s']:.3f})")
            print(f"  ratio pipeline/plain fast: {p_tps / f_tps:.3f} (CPU seconds: plain fast "
                  f"{fast['cpu_s']:.1f}, ratio {fast['cpu_s'] / pipe['cpu_s']:.3f})")
    rss1, rss4 = results[1][0]["peak_rss_mb"], results[4][0]["peak_rss_mb"]
    print(f"pipeline peak RSS 4x/1x: {rss4 / rss1:.2f} ({rss1:,.0f} MB -> {rss4:,.0f} MB)")


if __name__ == "__main__":
    main()

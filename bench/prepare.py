"""Throughput and peak memory of prepare vs plain batched `tokenizers` encoding.

One run: for 1x and 4x the input (a FineWeb-schema parquet of --docs and 4 * --docs
documents, row groups of 1000 rows), prepares it with Beam's in-process runner (or the
Beam flags after --) in a fresh process, then encodes the same texts with
`Tokenizer.encode_batch` in another fresh process, and prints tokens/s of both, their
ratio, and each process's peak RSS (its own and its children's: the multi-process runner's
workers). Example:
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
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline import qwen_tokenizer, sample_data, units  # noqa: E402

ENCODE_BATCH = 512


def _peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024  # Linux: KiB


def _child_prepare(args) -> dict:
    from pipeline import main as prepare_main
    from schemas import runspec as R

    spec = R.RunSpec(R.ModelSpec(""), R.TokenizerSpec(args.tokenizer),
                     (R.SourceSpec("fineweb", (args.parquet,)),),
                     packing=R.PackingSpec(args.mode, args.seq_len),
                     layout=R.LayoutSpec(rows_per_shard=8, partition_rows=64))
    started = time.perf_counter()
    manifest = prepare_main.run_prepare(spec, args.run, args.pipeline_args,
                                        unit_bytes=args.unit_bytes)
    return {"tokens": manifest.total_tokens, "seconds": time.perf_counter() - started,
            "peak_rss_mb": _peak_rss_mb()}


def _child_plain(args) -> dict:
    """The same texts, read as the pipeline reads them (row group by row group), encoded
    in batches in this one process: the speed the tokenizer allows here."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json"))
    started = time.perf_counter()
    n = 0
    for batch in pq.ParquetFile(args.parquet).iter_batches(batch_size=ENCODE_BATCH,
                                                           columns=["text"]):
        texts = batch.column(0).to_pylist()
        n += sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    return {"tokens": n, "seconds": time.perf_counter() - started,
            "peak_rss_mb": _peak_rss_mb()}


def _run_child(kind: str, args, **paths) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind,
           "--tokenizer", args.tokenizer, "--mode", args.mode, "--seq-len", str(args.seq_len),
           "--unit-bytes", str(args.unit_bytes)]
    for k, v in paths.items():
        cmd += [f"--{k}", v]
    out = subprocess.run(cmd + ["--", *args.pipeline_args], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=20000, help="documents at 1x")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--mode", default="segmented")
    parser.add_argument("--unit-bytes", type=int, default=units.DEFAULT_UNIT_BYTES)
    parser.add_argument("--tokenizer", default=None, help="default: the converted Qwen2.5")
    parser.add_argument("--child", choices=["prepare", "plain"], help=argparse.SUPPRESS)
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
          f"cpus={os.cpu_count()} beam_args={args.pipeline_args or '[]'}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="actx-bench-") as tmp:
        for scale in (1, 4):
            parquet = sample_data.make_fineweb_parquet(
                os.path.join(tmp, f"fw-{scale}x.parquet"), args.docs * scale, 0)
            size_mb = os.path.getsize(parquet) / 1e6
            pipe = _run_child("prepare", args, parquet=parquet,
                              run=os.path.join(tmp, f"run-{scale}x"))
            plain = _run_child("plain", args, parquet=parquet)
            if pipe["tokens"] != plain["tokens"]:
                raise SystemExit(f"token counts differ: pipeline {pipe['tokens']}, plain "
                                 f"{plain['tokens']}")
            results[scale] = (pipe, plain)
            p_tps, t_tps = pipe["tokens"] / pipe["seconds"], plain["tokens"] / plain["seconds"]
            print(f"{scale}x: {args.docs * scale} docs, {pipe['tokens']:,} tokens, parquet "
                  f"{size_mb:.1f} MB")
            print(f"  pipeline (end to end, incl. startup and writes): {pipe['seconds']:.2f}s, "
                  f"{p_tps:,.0f} tokens/s, peak RSS {pipe['peak_rss_mb']:,.0f} MB")
            print(f"  plain tokenizers encode_batch (one process):     {plain['seconds']:.2f}s, "
                  f"{t_tps:,.0f} tokens/s, peak RSS {plain['peak_rss_mb']:,.0f} MB")
            print(f"  ratio pipeline/plain: {p_tps / t_tps:.3f}")
    rss1, rss4 = results[1][0]["peak_rss_mb"], results[4][0]["peak_rss_mb"]
    print(f"pipeline peak RSS 4x/1x: {rss4 / rss1:.2f} ({rss1:,.0f} MB -> {rss4:,.0f} MB)")


if __name__ == "__main__":
    main()

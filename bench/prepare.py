"""Throughput of the local prepare pipeline vs plain batched `tokenizers` encoding.

One run: generates a FineWeb-schema parquet, prepares it with the in-process Beam runner,
then encodes the same texts with `Tokenizer.encode_batch` on the same machine, and prints
tokens/s of both and their ratio. Example:
  python bench/prepare.py --docs 20000 --seq-len 1024 -- --direct_num_workers=2 \
      --direct_running_mode=multi_processing
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline import main as prepare_main  # noqa: E402
from pipeline import qwen_tokenizer, sample_data  # noqa: E402
from schemas import runspec as R  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=5000)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--mode", default="segmented")
    parser.add_argument("--tokenizer", default=None, help="default: the converted Qwen2.5")
    parser.add_argument("pipeline_args", nargs="*", help="Beam flags, after --")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    tok_dir = args.tokenizer or qwen_tokenizer.ensure_qwen_tokenizer()
    with tempfile.TemporaryDirectory(prefix="actx-bench-") as tmp:
        parquet = sample_data.make_fineweb_parquet(os.path.join(tmp, "fw.parquet"), args.docs, 0)
        spec = R.RunSpec(R.ModelSpec(""), R.TokenizerSpec(tok_dir),
                         (R.SourceSpec("fineweb", (parquet,)),),
                         packing=R.PackingSpec(args.mode, args.seq_len),
                         layout=R.LayoutSpec(rows_per_shard=8, partition_rows=64))
        started = time.perf_counter()
        manifest = prepare_main.run_prepare(spec, os.path.join(tmp, "run"), args.pipeline_args)
        pipeline_s = time.perf_counter() - started

        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
        texts = [r["text"] for r in sample_data.make_fineweb_rows(args.docs, 0)]
        started = time.perf_counter()
        n_plain = 0
        for i in range(0, len(texts), 256):
            n_plain += sum(len(e.ids) for e in tok.encode_batch(texts[i:i + 256],
                                                                add_special_tokens=False))
        plain_s = time.perf_counter() - started
    pipeline_tps = manifest.total_tokens / pipeline_s
    plain_tps = n_plain / plain_s
    print(f"docs={args.docs} tokens={manifest.total_tokens} mode={args.mode} "
          f"seq_len={args.seq_len} cpus={os.cpu_count()} beam_args={args.pipeline_args or '[]'}")
    print(f"pipeline (end to end, incl. startup and writes): {pipeline_s:.2f}s, "
          f"{pipeline_tps:,.0f} tokens/s")
    print(f"plain tokenizers encode_batch:                   {plain_s:.2f}s, "
          f"{plain_tps:,.0f} tokens/s")
    print(f"ratio pipeline/plain: {pipeline_tps / plain_tps:.3f}")


if __name__ == "__main__":
    main()

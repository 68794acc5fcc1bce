"""End-to-end extraction throughput against forward-only and HF transformers, one run.

Builds a random-init Qwen2 checkpoint and a prepared token store on local disk, then times
(1) end to end: `workers.runner.Worker` reading the token store and writing committed
    activation shards to local disk (all partitions, after a warm-up partition),
(2) forward only: the same jitted step on the same batch shape, outputs left on device,
(3) HF transformers PyTorch: `output_hidden_states=True` plus a copy of the same hooked
    layers to host numpy,
and prints tokens/s (all positions of all rows) and the ratios.

  python bench/extract.py                      # CPU default, ~1-2 minutes
  python bench/extract.py --qwen05b --skip-hf  # Qwen2.5-0.5B shapes, bf16, for a GPU
  python bench/extract.py --length-mix [...]   # long documents: bench/long_documents.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def _parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_model_args(p, batch=8)
    p.add_argument("--partitions", type=int, default=4, help="timed partitions")
    p.add_argument("--steps-per-partition", type=int, default=4)
    p.add_argument("--hooked-layers", type=int, default=4, help="resid_post of the last N")
    p.add_argument("--store-dtype", default="bfloat16")
    p.add_argument("--codec", default="none", choices=["none", "zstd", "blosc"])
    p.add_argument("--dir", default=None, help="working directory (default: a temp dir)")
    return common.apply_presets(p.parse_args())


def _write_checkpoint(args, path: str) -> str:
    from tests import hf_models

    return str(hf_models.make_tiny_checkpoint(
        path, "qwen2", hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate, vocab_size=args.vocab,
        max_position_embeddings=max(args.seq, 4096)))


def main() -> None:
    args = _parse_args()
    import jax
    import numpy as np

    from schemas import manifest as manifest_lib
    from schemas import store as store_lib
    from tests import token_runs
    from workers import commit as commit_step
    from workers import runner, writer

    work = args.dir or tempfile.mkdtemp(prefix="actx-bench-")
    model_dir = _write_checkpoint(args, os.path.join(work, "model"))
    hooks = ",".join(f"layers.{i}.resid_post"
                     for i in range(args.layers - args.hooked_layers, args.layers))
    rows_per_partition = args.batch * args.steps_per_partition
    n_rows = rows_per_partition * (args.partitions + 1)  # +1: warm-up partition
    rows_per_shard = min(rows_per_partition, max(1, args.batch // 2))
    run = os.path.join(work, "run")
    token_runs.write_token_run(
        run, model_dir, n_rows=n_rows, seq_len=args.seq, vocab=args.vocab, hooks=hooks,
        dtype=args.store_dtype, model_dtype=args.dtype, rows_per_shard=rows_per_shard,
        partition_rows=rows_per_partition, codec=args.codec)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} x{jax.device_count()} ({jax.default_backend()}); "
          f"model hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"{args.dtype}; batch {args.batch} x seq {args.seq}; hooks {hooks}; "
          f"store {args.store_dtype}, codec {args.codec}")

    opts = runner.WorkerOptions(run=run, batch_size=args.batch, heartbeat_s=5.0)
    worker = runner.Worker(opts)
    pool = writer.WriterPool(opts.writer_threads, opts.max_pending_mb << 20)
    committer = commit_step.Committer(worker.store, worker.spec, worker.topo, worker.attempt,
                                      "bench")
    worker.run_partition(0, pool, committer)  # warm-up: compile, open arrays
    committer.drain()
    pool.wait_s = 0.0
    start = time.perf_counter()
    for pid in range(1, args.partitions + 1):
        worker.run_partition(pid, pool, committer)
    committer.drain()  # every timed partition committed: data durable, markers written
    e2e_s = time.perf_counter() - start
    committer.close()
    pool.shutdown()
    timed_rows = args.partitions * rows_per_partition
    e2e_tps = timed_rows * args.seq / e2e_s
    m = manifest_lib.read_manifest(store_lib.open_store(run))
    valid = sum(p.tokens for p in m.partitions[1:])

    # Forward only: the same step and batch, outputs stay on device.
    ids = np.asarray(token_runs.read_tokens(run, "input_ids")[:args.batch])
    seg = np.asarray(token_runs.read_tokens(run, "segment_ids")[:args.batch])
    pos = np.asarray(token_runs.read_tokens(run, "positions")[:args.batch])
    fn = worker.fn

    def forward():
        out = fn(ids, pos, seg)
        jax.block_until_ready(out)

    fwd_tps = args.batch * args.seq / common.median_seconds(
        forward, max(5, args.steps_per_partition))

    print(f"end to end (token store -> committed shards): {e2e_tps:12,.0f} tokens/s "
          f"({timed_rows} rows, {valid:,} non-padding tokens, {e2e_s:.2f} s; "
          f"writer wait {pool.wait_s:.2f} s)")
    print(f"forward only, same step and batch:            {fwd_tps:12,.0f} tokens/s")
    print(f"ratio end-to-end / forward-only:              {e2e_tps / fwd_tps:12.3f}")
    if args.skip_hf:
        return
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    # SDPA: HF's fastest built-in attention, so the baseline is a fair one.
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, args.dtype), attn_implementation="sdpa").eval()
    layer_ids = [int(h.split(".")[1]) for h in hooks.split(",")]
    ids_t = torch.as_tensor(ids, dtype=torch.long)

    def hf_extract():
        with torch.no_grad():
            out = hf.model(input_ids=ids_t, output_hidden_states=True)
        # hidden_states[i + 1] is resid_post of layer i (the last is after the final norm,
        # which costs HF nothing extra); copy the hooked ones to host as actx stores them.
        return [out.hidden_states[i + 1].to(torch.bfloat16).float().numpy() for i in layer_ids]

    hf_tps = args.batch * args.seq / common.median_seconds(
        hf_extract, max(3, args.steps_per_partition))
    print(f"HF transformers (hidden states + host copy):  {hf_tps:12,.0f} tokens/s")
    print(f"ratio actx end-to-end / HF:                   {e2e_tps / hf_tps:12.3f}")
    print(f"ratio actx forward-only / HF:                 {fwd_tps / hf_tps:12.3f}")


if __name__ == "__main__":
    if "--length-mix" in sys.argv:
        # FineWeb-like document lengths: exact context vs rows alone vs truncate (issue 9),
        # its own script because it builds and extracts three token stores.
        sys.argv.remove("--length-mix")
        from bench import long_documents

        long_documents.main()
    else:
        main()

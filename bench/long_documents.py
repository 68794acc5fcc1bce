"""What exact long-document context costs: one run, three ways over the same documents.

FineWeb-like lengths (log-normal, median ~600 tokens, a tail past 8k) are packed at
seq_len 1024 (`segmented`) and extracted end to end (token store -> committed shards):
  exact        overflow "continue": a document's rows run through one slot with its KV
               cache, so every token sees its document (up to max_context);
  independent  the same token store, every row computed as if its document started
               there (actx before the cache; wrong for continuation rows, timed only as
               the baseline);
  truncate     the same documents cut at seq_len (fewer stored tokens).
All three use the attention implementation the backend chooses (`--attention` names
another; printed at the start), so the baseline has the best kernel too; `--also IMPL`
times exact with a second implementation in the same rounds (e.g. `--also cudnn` on a GPU:
the fused call that computes every cached key, the GPU's way before the Pallas kernel).
Prints stored tokens/s of each, the steps each ran (a long document's rows go through one
slot, so exact can need more steps than rows / batch) and seconds per step (the cost of
attending to the cached context), and the ratios; the target is exact >= 0.85 x
independent.

The default model has Qwen2.5-0.5B's layer shapes (hidden 896, 14/2 heads of 64, MLP
4864) and 4 layers (the scan stops after the last hooked layer, so hooking layers 2-3 of
the real model runs exactly these), in float32 on the CPU: the share of attention in a
step, which is what the cached context adds to, is then that of the real model. A toy
width (`--hidden 256 --heads 8 --intermediate 1024`, head_dim 32) spends most of a CPU
step in attention and overstates the cost.

  python bench/long_documents.py              # CPU default, ~6-8 minutes on 2 cores
  python bench/long_documents.py --qwen05b --skip-hf   # all 24 layers, bf16, for a GPU
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
    p.set_defaults(seq=1024, hidden=896, heads=14, kv_heads=2, intermediate=4864, layers=4)
    p.add_argument("--docs", type=int, default=80, help="documents in the mix")
    p.add_argument("--median", type=float, default=600.0, help="median document tokens")
    p.add_argument("--sigma", type=float, default=1.2, help="log-normal sigma")
    p.add_argument("--max-context", type=int, default=8192)
    p.add_argument("--hooked-layers", type=int, default=2, help="resid_post of the last N")
    p.add_argument("--partition-rows", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="time exact and independent this many times each, alternating "
                        "which goes first (a busy machine moves single runs); the "
                        "median of each is reported, with every round's ratio")
    p.add_argument("--attention", default=None,
                   help="attention implementation (workers.attention.dispatch.IMPLEMENTATIONS); "
                        "default: the backend's choice")
    p.add_argument("--also", default=None, metavar="IMPL",
                   help="also time exact with this attention implementation")
    return common.apply_presets(p.parse_args())


def _lengths(args):
    import numpy as np

    rng = np.random.default_rng(args.seed)
    lengths = np.exp(rng.normal(np.log(args.median), args.sigma, args.docs)).astype(int)
    lengths = np.clip(lengths, 1, 4 * args.max_context)
    lengths[0] = max(lengths[0], args.max_context + args.seq + 17)  # the tail past 8k
    return [int(n) for n in lengths]


def _extract(run: str, batch: int, independent: bool = False,
             attention: str | None = None) -> tuple[float, int, int]:
    """Seconds to extract and commit every partition (after compiling the step on a dummy
    batch), stored tokens, and the steps run."""
    import dataclasses

    import jax
    import numpy as np

    from actx.schemas import manifest as manifest_lib
    from actx.schemas import store as store_lib
    from actx.schemas import worker_options
    from actx.workers.loop import runner
    from actx.workers.model import step

    worker = runner.Worker(worker_options.WorkerOptions(run=run, batch_size=batch, heartbeat_s=30))
    if independent:
        # The old behaviour, for the baseline only: no cache, rows computed alone.
        worker.loaded = dataclasses.replace(worker.loaded, max_context=None)
    if independent or attention:
        loaded = worker.loaded
        worker.loaded = dataclasses.replace(loaded, fn=step.make_extract_fn(
            loaded.model, loaded.capture, worker.mesh, attention_impl=attention,
            max_context=loaded.max_context))
    m = manifest_lib.read_manifest(store_lib.open_store(run))
    # Compile on a dummy batch placed as the worker places its inputs (global arrays on
    # the step's shardings): numpy inputs compile another executable, which the timed run
    # would then compile again.
    dummy = worker.transfer.tokens(np.ones((batch, m.seq_len), np.int32))
    kwargs = ({} if worker.loaded.max_context is None
              else {"continues": worker.transfer.slots(np.zeros(batch, bool))})
    jax.block_until_ready(worker.loaded.fn(dummy, dummy, dummy, **kwargs))
    start = time.perf_counter()
    assert worker.run() == 0  # every partition, as `actx submit` runs a worker
    seconds = time.perf_counter() - start
    if worker.loaded.max_context is not None:
        steps = worker.progress.step  # one stream of steps over all partitions
    else:
        steps = sum(len(worker.plan_steps(p)) for p in m.partitions)
    return seconds, m.total_tokens, steps


def _attended_keys(run: str) -> tuple[float, float]:
    """Mean keys a stored token attends to (per layer and head), (exact, rows alone), from
    the token store: exact attends positions context_start..position of its document;
    alone, only its document's tokens earlier in the same row."""
    import numpy as np

    from actx import reader

    r = reader.open_run(run)
    # The token arrays alone: what each token attended to is recorded there.
    pos, seg, ctx = (r.token_array(name).read().result().astype(np.int64)
                     for name in ("positions", "segment_ids", "context_start"))
    valid = seg > 0
    cols = np.broadcast_to(np.arange(seg.shape[1]), seg.shape)
    starts = np.ones_like(seg, bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    first_col = np.maximum.accumulate(np.where(starts, cols, 0), axis=1)
    in_row = (cols - first_col + 1)[valid]
    return float((pos - ctx + 1)[valid].mean()), float(in_row.mean())


def _ideal_ratio(args, keys_exact: float, keys_alone: float) -> float:
    """Independent / exact FLOPs per stored token: the layer's matmuls plus 4 * heads *
    head_dim per attended key (QK^T and PV), as a kernel that computes only attended keys
    would spend them."""
    head_dim = args.hidden // args.heads
    matmuls = 2 * (args.hidden * head_dim * (2 * args.heads + 2 * args.kv_heads)
                   + 3 * args.hidden * args.intermediate)
    per_key = 4 * args.heads * head_dim
    return (matmuls + per_key * keys_alone) / (matmuls + per_key * keys_exact)


def main() -> None:
    args = _parse_args()
    import jax
    import numpy as np

    from tests import hf_models, token_runs

    work = tempfile.mkdtemp(prefix="actx-bench-long-")
    model_dir = str(hf_models.make_tiny_checkpoint(
        os.path.join(work, "model"), "qwen2", hidden_size=args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
        vocab_size=args.vocab, max_position_embeddings=max(32768, args.max_context),
        dtype=args.dtype))
    hooks = ",".join(f"layers.{i}.resid_post"
                     for i in range(args.layers - args.hooked_layers, args.layers))
    lengths = _lengths(args)

    def fresh_run(name: str, overflow: str) -> str:
        # Every timing gets its own copy of the token store: the baseline's (wrong)
        # activations must never land in the exact run's arrays, and a run extracts once.
        run = os.path.join(work, name)
        token_runs.write_long_document_run(
            run, model_dir, mode="segmented", overflow=overflow, seq_len=args.seq,
            max_context=args.max_context, lengths=lengths, hooks=hooks,
            rows_per_shard=max(1, args.batch), partition_rows=args.partition_rows,
            vocab=args.vocab, model_dtype=args.dtype, store_dtype="bfloat16")
        return run

    lengths_arr = np.asarray(lengths)
    rows = -(-lengths_arr // args.seq)
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()} "
          f"({jax.default_backend()}); model hidden {args.hidden}, {args.layers} layers, "
          f"{args.dtype}; batch {args.batch} x seq {args.seq}; hooks {hooks}")
    print(f"documents: {len(lengths)}, {lengths_arr.sum():,} tokens; median "
          f"{int(np.median(lengths_arr))}, max {lengths_arr.max():,}; "
          f"{(rows > 1).mean():.0%} of documents and "
          f"{lengths_arr[rows > 1].sum() / lengths_arr.sum():.0%} of tokens span several rows; "
          f"{np.maximum(0, lengths_arr - args.max_context).sum():,} tokens past "
          f"max_context {args.max_context}")
    from actx.workers.attention import dispatch as attention

    chosen = attention.implementation_for(args.dtype, args.seq, args.hidden // args.heads,
                                          requested=args.attention)
    print(f"attention implementation: {chosen} (this backend prefers "
          f"{attention.default_implementation(args.dtype)})"
          + (f"; also timing exact with {args.also}" if args.also else ""))
    ways = {"exact": ("continue", False, args.attention),
            "independent": ("continue", True, args.attention)}
    if args.also:
        ways[f"exact, {args.also}"] = ("continue", False, args.also)
    timings: dict[str, list[tuple[float, int, int]]] = {name: [] for name in ways}
    for r in range(args.rounds):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for name in order:
            overflow, independent, impl = ways[name]
            timings[name].append(_extract(
                fresh_run(f"{name.replace(', ', '-')}{r}", overflow), args.batch,
                independent=independent, attention=impl))
    results = {name: sorted(runs, key=lambda x: x[0])[len(runs) // 2]
               for name, runs in timings.items()}
    results["truncate"] = _extract(fresh_run("truncate", "truncate"), args.batch,
                                   attention=args.attention)
    tps = {name: tokens / seconds for name, (seconds, tokens, _) in results.items()}
    for name, (seconds, tokens, steps) in results.items():
        print(f"{name:18s} {tps[name]:12,.0f} stored tokens/s  ({tokens:,} tokens, "
              f"{steps} steps of {args.batch} rows, {seconds:.2f} s, "
              f"{seconds / steps:.3f} s a step)")
    if args.rounds > 1:
        per_round = [i_s / e_s for (e_s, _, _), (i_s, _, _)
                     in zip(timings["exact"], timings["independent"])]
        print("ratio exact / independent per round: "
              + ", ".join(f"{x:.3f}" for x in per_round))
    print(f"ratio exact / independent rows:  {tps['exact'] / tps['independent']:.3f} "
          f"(target >= 0.85)")
    print(f"ratio exact / truncate:          {tps['exact'] / tps['truncate']:.3f}")
    if args.also:
        print(f"ratio exact {chosen} / exact {args.also}: "
              f"{tps['exact'] / tps[f'exact, {args.also}']:.3f}")
    # Any "continue" store of these documents holds the same token arrays.
    keys_exact, keys_alone = _attended_keys(os.path.join(work, "exact0"))
    print(f"keys a stored token attends to: {keys_exact:,.0f} exact, {keys_alone:,.0f} with "
          f"rows alone (mean); FLOP ratio for a kernel that computes only those: "
          f"{_ideal_ratio(args, keys_exact, keys_alone):.3f}")


if __name__ == "__main__":
    main()

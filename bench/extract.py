"""End to end through the production path against the same step's forward-only rate.

Builds a random-init Qwen2 checkpoint and token stores of FineWeb-like documents (log-normal
lengths) on local disk, packed twice: `overflow: continue` (the default: long documents
carry their context from row to row) and `overflow: truncate` (rows independent). For each,
each `--steps-in-flight` and each `--output-memory`, every round times
(1) end to end: `Worker.run()`, the code `actx extract` runs (partition choice, prefetch,
    step, outputs, writer, commit), over every partition of a fresh copy of the token store,
    until the last marker is written (model load and compilation before the clock starts),
(2) forward only: the same step function on the same steps' inputs, in order, back to back,
    outputs left on device: one pass just before (1) and one just after it, so a machine
    whose speed drifts (shared cores) drifts for both; the ratio is against their mean, and
    against the faster of the two as well (the harsher reading),
and prints steps per second of both and their ratio, the schedule's fill (stored rows per
slot computed), and the host's milliseconds per step: waiting for outputs, copying them into
blocks, writing (writer threads, off the loop), the writer's wait and the dispatcher's wait.
Medians over `--rounds`; an untimed run of each store first records the steps the first
pass replays (and warms the page cache as the later runs find it). HF transformers (hidden
states copied into preallocated host buffers, pinned on a GPU) is timed once at the end, and
with --minimal-jax the minimal JAX script too (bench/minimal_jax.py: a plain jitted forward
of the same model returning the same hooked layers into pinned host memory, copied into
numpy buffers, no storage; the ceiling an extraction tool could reach, issue 49); end to
end is printed as a ratio of each.

  python bench/extract.py                      # CPU default, a few minutes
  python bench/extract.py --qwen05b --skip-hf  # Qwen2.5-0.5B shapes, bf16, for a GPU
  python bench/extract.py --length-mix [...]   # exact context vs rows alone: long_documents.py
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

PACKINGS = ("continue", "truncate")


def _parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_model_args(p, batch=8)
    p.add_argument("--partitions", type=int, default=4,
                   help="partitions of each store (about; documents are drawn to fill them)")
    p.add_argument("--steps-per-partition", type=int, default=8)
    p.add_argument("--steps-in-flight", default="2", help="comma list, each one measured")
    p.add_argument("--packing", default=",".join(PACKINGS), help="comma list of " +
                   " / ".join(PACKINGS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--median-tokens", type=float, default=600.0, help="median document")
    p.add_argument("--hooked-layers", type=int, default=4, help="resid_post of the last N")
    p.add_argument("--store-dtype", default="bfloat16")
    p.add_argument("--codec", default="none", choices=["none", "zstd", "blosc"])
    p.add_argument("--rows-per-shard", type=int, default=None,
                   help="rows per stored object (default: the layout's, "
                        "schemas.runspec.LayoutSpec, where it divides a partition); each "
                        "object costs its write a fixed price (on a local disk: two fsyncs "
                        "and a rename)")
    p.add_argument("--copy-threads", default="auto",
                   help="comma list, each one measured: threads copying rows into the "
                        "writer's blocks (workers.write.block_copy; auto: its default_threads)")
    p.add_argument("--minimal-jax", action="store_true",
                   help="also time bench/minimal_jax.py on the same model and batch")
    p.add_argument("--dir", default=None, help="working directory (default: a temp dir)")
    p.add_argument("--output-memory", default="auto",
                   help="comma list, each one measured: where the step's outputs land "
                        "(workers.loop.transfer.OUTPUT_MEMORY): auto (pinned_copy on GPUs, "
                        "pinned_host on TPUs), device (then an async copy), pinned_host, pinned_copy "
                        "(device, then an async copy into pinned host memory)")
    return common.apply_presets(p.parse_args())


def _lengths(args, target_rows: int, packing: str) -> list[int]:
    """Log-normal document lengths (sigma 1.2), enough to fill about `target_rows` rows
    once packed with `packing` (truncated documents keep one row's worth)."""
    import numpy as np

    rng = np.random.default_rng(0)
    lengths, tokens = [], 0
    while tokens < target_rows * args.seq:
        n = int(np.clip(np.exp(rng.normal(np.log(args.median_tokens), 1.2)), 1,
                        16 * args.seq))
        lengths.append(n)
        tokens += min(n, args.seq) if packing == "truncate" else n
    return lengths


def _token_store(args, model_dir: str, path: str, packing: str, lengths, hooks: str) -> int:
    """Writes the token store; returns its partitions."""
    from tests import token_runs

    token_runs.write_long_document_run(
        path, model_dir, mode="segmented", seq_len=args.seq, max_context=4 * args.seq,
        lengths=lengths, hooks=hooks, rows_per_shard=_rows_per_shard(args),
        partition_rows=args.batch * args.steps_per_partition, vocab=args.vocab,
        overflow=packing, model_dtype=args.dtype, store_dtype=args.store_dtype,
        codec=args.codec)
    from actx.schemas import manifest, store

    return len(manifest.read_manifest(store.open_store(path)).partitions)


def _fresh_copy(src: str, dest: str) -> str:
    shutil.rmtree(dest, ignore_errors=True)
    from tests import worker_procs

    return worker_procs.copy_token_store(src, dest)


def _rows_per_shard(args) -> int:
    """--rows-per-shard, or the layout's default where it divides a partition's rows."""
    import math

    from actx.schemas import runspec

    return args.rows_per_shard or math.gcd(runspec.LayoutSpec().rows_per_shard,
                                           args.batch * args.steps_per_partition)


def _end_to_end(args, run: str, in_flight: int, calls_before: list | None) -> dict:
    """One timed `Worker.run()` over every partition of `run`, between two forward-only
    passes: one over `calls_before` (the previous run's inputs of this store: the same
    steps) before it, one over its own inputs after it (the module's docstring says why)."""
    import dataclasses

    import jax
    import numpy as np

    from actx.schemas import worker_options
    from actx.workers.loop import runner
    from actx.workers.model import step

    worker = runner.Worker(worker_options.WorkerOptions(run=run, batch_size=args.batch,
                                                steps_in_flight=in_flight, heartbeat_s=5.0))
    # Compile on inputs placed as the loop places them (global arrays on the step's
    # shardings): numpy inputs would compile another executable.
    tokens = worker.transfer.tokens(np.ones((args.batch, args.seq), np.int32))
    loaded = worker.loaded
    kwargs = ({} if loaded.max_context is None
              else {"continues": worker.transfer.slots(np.zeros(args.batch, bool))})
    step_fn = loaded.fn
    jax.block_until_ready(step_fn(tokens, tokens, tokens, **kwargs))
    compiled = step_fn.compile_count()
    calls = []

    def recorded(*inputs, **kw):  # the run's inputs, replayed by the forward-only pass
        calls.append((inputs, kw))
        return step_fn(*inputs, **kw)

    worker.loaded = dataclasses.replace(loaded, fn=recorded)
    # Forward only: the same step on the run's own inputs, in order, back to back, outputs
    # left on device.
    fn = step.make_extract_fn(loaded.model, loaded.capture, worker.mesh,
                              max_context=loaded.max_context)
    jax.block_until_ready(fn(tokens, tokens, tokens, **kwargs))

    def forward_only(inputs) -> float:
        compiled_fwd = fn.compile_count()
        start = time.perf_counter()
        for args_, kw in inputs:
            outs = fn(*args_, **kw)
        jax.block_until_ready(outs)
        seconds = time.perf_counter() - start
        assert fn.compile_count() == compiled_fwd, "the forward-only pass compiled again"
        return seconds

    before_s = forward_only(calls_before) if calls_before else None
    start = time.perf_counter()
    assert worker.run() == 0
    seconds = time.perf_counter() - start
    assert step_fn.compile_count() == compiled, "the timed run compiled the step again"
    after_s = forward_only(calls)
    if calls_before:
        assert len(calls_before) == len(calls), "the same store planned other steps"
    n = len(calls)
    forward = [x for x in (before_s, after_s) if x is not None]
    return dict(steps=n, e2e_steps_per_s=n / seconds,
                fwd_steps_per_s=n / statistics.mean(forward),
                fwd_fastest_steps_per_s=n / min(forward),
                fill=worker.manifest.total_rows / (n * args.batch), seconds=seconds,
                partitions=len(worker.manifest.partitions), calls=calls,
                **worker.timings.per_step_ms())


def _memory(jax, transfer, mode: str) -> str:
    """Where `mode` puts a step's outputs on this backend, in words."""
    transfer.OUTPUT_MEMORY = mode
    kind = transfer.output_memory_kind(jax)
    if kind is not None:
        return f"written to {kind} by the step"
    copy = transfer.copy_memory_kind(jax)
    if copy is None and jax.default_backend() == "cpu":
        return "device memory, which is host memory here"
    return f"device, copied to {copy or 'host memory'}"


def _hf(args, model_dir: str, hooks: str) -> tuple[float, str]:
    """HF transformers tokens/s: hidden states copied into host buffers (pinned on a GPU),
    on the GPU where there is one."""
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    # SDPA: HF's fastest built-in attention, so the baseline is a fair one.
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, args.dtype), attn_implementation="sdpa").eval()
    hf = hf.to("cuda" if torch.cuda.is_available() else "cpu")
    ids = np.random.default_rng(0).integers(1, args.vocab, (args.batch, args.seq))
    return common.hf_extraction_tokens_per_s(hf, ids, _layers(hooks), 5)


def _layers(hooks: str) -> list[int]:
    return [int(h.split(".")[1]) for h in hooks.split(",")]


def _minimal_jax(args, model_dir: str, hooks: str, steps: int) -> dict[str, float]:
    """The minimal JAX script's tokens/s over `steps` random batches of the same shape,
    with jax.nn.dot_product_attention's default and, on a GPU, its fused cuDNN kernel."""
    import jax
    import numpy as np

    from bench import minimal_jax

    params, config = minimal_jax.load_params(model_dir, args.dtype)
    rng = np.random.default_rng(0)
    ids = [rng.integers(1, args.vocab, (args.batch, args.seq)).astype(np.int32)
           for _ in range(steps)]
    rates = {}
    for attention in (None, "cudnn") if jax.default_backend() == "gpu" else (None,):
        try:
            rate, memory = minimal_jax.tokens_per_s(params, config, ids, _layers(hooks),
                                                    attention=attention)
        except Exception as e:  # a kernel this GPU or dtype lacks: say so, go on
            print(f"minimal JAX with {attention} attention failed: {str(e)[:300]}")
            continue
        rates[f"minimal JAX ({attention or 'default'} attention, {len(_layers(hooks))} "
              f"layers -> {memory}, copied to numpy)"] = rate
    return rates


def main() -> None:
    args = _parse_args()
    import jax

    from actx.workers.loop import transfer

    modes = args.output_memory.split(",")
    for mode in modes:
        if mode not in transfer.OUTPUT_MEMORY_MODES:
            raise SystemExit(f"--output-memory {mode!r}: one of "
                             f"{', '.join(transfer.OUTPUT_MEMORY_MODES)}")

    from tests import hf_models

    work = args.dir or tempfile.mkdtemp(prefix="actx-bench-")
    model_dir = str(hf_models.make_tiny_checkpoint(
        os.path.join(work, "model"), "qwen2", hidden_size=args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
        vocab_size=args.vocab, max_position_embeddings=max(8 * args.seq, 4096)))
    hooks = ",".join(f"layers.{i}.resid_post"
                     for i in range(args.layers - args.hooked_layers, args.layers))
    packings = args.packing.split(",")
    lengths = {p: _lengths(args, args.batch * args.steps_per_partition * args.partitions, p)
               for p in packings}
    in_flights = [int(x) for x in args.steps_in_flight.split(",")]
    stores = {p: os.path.join(work, f"tokens-{p}") for p in packings}
    for packing, path in stores.items():
        _token_store(args, model_dir, path, packing, lengths[packing], hooks)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} x{jax.device_count()} ({jax.default_backend()}); "
          f"model hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"{args.dtype}; batch {args.batch} x seq {args.seq}; hooks {hooks}; "
          f"store {args.store_dtype}, codec {args.codec}, {_rows_per_shard(args)} rows an "
          f"object; outputs: "
          f"{', '.join(f'{m} ({_memory(jax, transfer, m)})' for m in modes)}; documents: "
          f"{', '.join(f'{len(v)} ({p})' for p, v in lengths.items())}, median "
          f"{args.median_tokens:.0f} tokens; {args.rounds} rounds")
    from actx.workers.write import block_copy

    default_threads = block_copy.default_threads
    copies = [default_threads() if c == "auto" else int(c)
              for c in args.copy_threads.split(",")]
    configs = [(p, f, m, c) for p in packings for f in in_flights for m in modes
               for c in copies]
    calls: dict[str, list] = {}
    for packing in packings:  # untimed: records the store's steps for the first pass
        transfer.OUTPUT_MEMORY = modes[0]
        calls[packing] = _end_to_end(args, _fresh_copy(stores[packing], os.path.join(
            work, "run")), in_flights[0], None)["calls"]
    results: dict[tuple[str, int, str, int], list[dict]] = {}
    for r in range(args.rounds):
        for packing, in_flight, mode, copy in configs:
            transfer.OUTPUT_MEMORY = mode
            block_copy.default_threads = lambda copy=copy: copy
            run = _fresh_copy(stores[packing], os.path.join(work, "run"))
            got = _end_to_end(args, run, in_flight, calls[packing])
            calls[packing] = got.pop("calls")
            results.setdefault((packing, in_flight, mode, copy), []).append(got)
            print(f"round {r + 1} {packing:8s} steps in flight {in_flight}, outputs {mode}, "
                  f"{copy} copy threads: "
                  f"{got['steps']} steps over {got['partitions']} partitions, end to end / "
                  f"forward-only {got['e2e_steps_per_s'] / got['fwd_steps_per_s']:.3f}",
                  flush=True)
    tokens_per_step = args.batch * args.seq
    print()
    for (packing, in_flight, mode, copy), rounds in results.items():
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        ratios = [r["e2e_steps_per_s"] / r["fwd_steps_per_s"] for r in rounds]
        fastest = [r["e2e_steps_per_s"] / r["fwd_fastest_steps_per_s"] for r in rounds]
        print(f"overflow: {packing}, steps in flight {in_flight}, outputs {mode}, {copy} "
              f"copy threads "
              f"({rounds[0]['steps']} steps, {rounds[0]['partitions']} partitions; "
              f"medians of {len(rounds)} rounds)")
        print(f"  end to end (token store -> committed shards): "
              f"{med['e2e_steps_per_s'] * tokens_per_step:12,.0f} tokens/s of slots "
              f"({med['seconds']:.2f} s; {med['fill']:.3f} of the slots are stored rows)")
        print(f"  forward only, same step and batch:            "
              f"{med['fwd_steps_per_s'] * tokens_per_step:12,.0f} tokens/s (the passes "
              f"before and after)")
        print(f"  ratio end-to-end / forward-only:              "
              f"{statistics.median(ratios):12.3f}  (rounds: "
              f"{', '.join(f'{x:.3f}' for x in ratios)})")
        print(f"  ratio against the faster forward pass:        "
              f"{statistics.median(fastest):12.3f}  (rounds: "
              f"{', '.join(f'{x:.3f}' for x in fastest)})")
        print(f"  host ms per step: waiting {med['waiting']:.1f}, copying {med['copying']:.2f}, "
              f"writing {med['writing']:.2f} (writer threads); writer wait "
              f"{med['writer_wait']:.2f}, dispatch wait {med['dispatch_wait']:.1f}; "
              f"step {1000 / med['fwd_steps_per_s']:.1f} ms forward only")
    baselines = {}
    if args.minimal_jax:
        steps = min(32, max(r[0]["steps"] for r in results.values()))
        baselines.update(_minimal_jax(args, model_dir, hooks, steps))
    if not args.skip_hf:
        rate, label = _hf(args, model_dir, hooks)
        baselines[label] = rate
    for label, rate in baselines.items():
        print(f"{label}: {rate:12,.0f} tokens/s")
        for (packing, in_flight, mode, copy), rounds in results.items():
            e2e = statistics.median(r["e2e_steps_per_s"] for r in rounds) * tokens_per_step
            print(f"  end to end ({packing}, steps in flight {in_flight}, outputs {mode}, "
                  f"{copy} copy threads) / this: {e2e / rate:.3f}")


if __name__ == "__main__":
    if "--length-mix" in sys.argv:
        # FineWeb-like document lengths: exact context vs rows alone vs truncate (issue 9),
        # its own script because it builds and extracts three token stores.
        sys.argv.remove("--length-mix")
        from bench import long_documents

        long_documents.main()
    else:
        main()

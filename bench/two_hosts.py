"""Two local hosts over a few partitions of long documents: does each host do its half?

The held-out case of issue 50: 2 replicas of one host each (`actx submit` with a local
target, `hosts: 2`, stealing on as a job has it), 4 partitions of a few long documents
each (every document longer than a row, so its rows form a chain that runs through one
batch slot for many steps, and a host's 8 slots want more chains than one partition holds).
Each round extracts the same token store twice, with 1 host and with 2 (the order
alternating between rounds), through the local launcher as `actx submit` runs it, and
prints per host the tokens it extracted and the partitions it committed (from its
heartbeat, with the sharing counters where the heartbeat has them), the wall time of each
launch (process start to the last exit: loading and compiling included, as a user waits),
and the ratio of the 2-host time to the 1-host time. Shares are exact token counts; times
move with whatever else the machine runs.

  python bench/two_hosts.py                 # 4 rounds, ~4-6 minutes on 2 cores
  python bench/two_hosts.py --rounds 1
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--docs-per-partition", type=int, default=2)
    p.add_argument("--doc-rows", type=int, default=32,
                   help="rows of each document (a chain of this many steps)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="batch slots of each host")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-context", type=int, default=512)
    return p.parse_args()


def _host_lines(run: str) -> list[dict]:
    """Each host's heartbeat, as the sharing report needs it."""
    from actx.schemas import heartbeat, store

    out = []
    for hb in heartbeat.read_heartbeats(store.open_store(run)):
        # The sharing counters exist in heartbeats from issue 50 on (the "before" figures
        # were taken without them).
        out.append({"host": hb.host, "state": hb.state, "tokens": hb.tokens_done,
                    "committed": hb.partitions_done,
                    "stolen": dict(getattr(hb, "stolen_from", {}) or {}),
                    "given_up": dict(getattr(hb, "given_up", {}) or {}),
                    "idle_reason": getattr(hb, "idle_reason", "")})
    return sorted(out, key=lambda h: h["host"])


def _extract(token_store: str, work: str, name: str, hosts: int, batch: int,
             fingerprint: str) -> tuple[float, list[dict]]:
    from actx.deploy import config as config_lib
    from actx.deploy import local
    from tests import worker_procs

    run = worker_procs.copy_token_store(token_store, os.path.join(work, name))
    target = config_lib.TargetConfig(kind="local", hosts=hosts, batch_size=batch,
                                     devices_per_host=1, heartbeat_s=1.0)
    out = io.StringIO()
    started = time.perf_counter()
    code = local.run_workers(run, target, fingerprint, job=name, out=out, progress_s=1.0)
    seconds = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"{name}: the workers failed:\n{out.getvalue()}")
    return seconds, _host_lines(run)


def main() -> None:
    args = _parse_args()
    from tests import hf_models, token_runs

    work = tempfile.mkdtemp(prefix="actx-bench-two-hosts-")
    model = str(hf_models.make_tiny_checkpoint(
        os.path.join(work, "model"), "qwen2", hidden_size=args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=4 * args.hidden, vocab_size=512,
        max_position_embeddings=max(4096, args.max_context)))
    # Each document fills doc_rows rows exactly (its last row too), so a partition of
    # docs_per_partition * doc_rows rows holds docs_per_partition whole chains.
    n_docs = args.partitions * args.docs_per_partition
    lengths = [args.doc_rows * args.seq] * n_docs
    tokens_dir = os.path.join(work, "tokens")
    spec, _ = token_runs.write_long_document_run(
        tokens_dir, model, seq_len=args.seq, max_context=args.max_context, lengths=lengths,
        hooks=f"layers.{args.layers - 1}.resid_post", rows_per_shard=args.doc_rows,
        partition_rows=args.docs_per_partition * args.doc_rows, vocab=512,
        store_dtype="bfloat16")
    total = sum(lengths)
    print(f"{args.partitions} partitions of {args.docs_per_partition} documents of "
          f"{args.doc_rows} rows x {args.seq} tokens ({total:,} tokens); {args.batch} slots a "
          f"host; model hidden {args.hidden}, {args.layers} layers; cpu count {os.cpu_count()}")
    walls: dict[int, list[float]] = {1: [], 2: []}
    idle_rounds, worst_share = 0, 1.0
    for r in range(args.rounds):
        order = (1, 2) if r % 2 == 0 else (2, 1)
        for hosts in order:
            seconds, beats = _extract(tokens_dir, work, f"r{r}-{hosts}h", hosts, args.batch,
                                      spec.fingerprint)
            walls[hosts].append(seconds)
            shares = [b["tokens"] / total for b in beats]
            detail = "; ".join(
                f"{b['host']} {b['tokens']:,} tokens ({share:.0%}), {b['committed']} "
                f"committed" + (f", stolen {b['stolen']}" if b["stolen"] else "")
                + (f", given up {b['given_up']}" if b["given_up"] else "")
                + (f", idle: {b['idle_reason']}" if b["idle_reason"] else "")
                for b, share in zip(beats, shares))
            print(f"round {r} {hosts} host(s): {seconds:.1f}s wall; {detail}", flush=True)
            if hosts == 2:
                idle_rounds += min(b["tokens"] for b in beats) == 0
                worst_share = min(worst_share, min(shares))
    one, two = statistics.median(walls[1]), statistics.median(walls[2])
    print(f"median wall: 1 host {one:.1f}s, 2 hosts {two:.1f}s; ratio 2 hosts / 1 host "
          f"{two / one:.3f} (rounds: "
          + ", ".join(f"{b / a:.3f}" for a, b in zip(walls[1], walls[2])) + ")")
    print(f"2-host rounds with an idle host (0 tokens): {idle_rounds} of {args.rounds}; "
          f"smallest host share {worst_share:.1%} (half is 50%; within 25% of half is "
          f">= 37.5%)")


if __name__ == "__main__":
    main()

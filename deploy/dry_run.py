"""What a job will cost, before it runs (`actx submit --dry-run`, every target): its tokens
and rows, and for the activations the bytes of each hook and in all and the objects they
take; with `--estimate`, its time.

Tokens and rows come from the run's manifest when the run is already prepared for this
spec; otherwise from a prepare of the inputs into memory (nothing is written to the run),
local or gs:// alike: whole up to `COUNT_INPUT_BYTES`, sampled by files and scaled by bytes
beyond it. Each hook's width comes from the checkpoint's config.json. Sizes are
uncompressed: the stored zstd shards are at most about that. The time is a timed run of
one worker here on the local target, and the bound of the accelerators' peak on the others
(deploy.cost_bound), whose hardware this machine cannot time.
"""

from __future__ import annotations

import dataclasses
import math
import os
import uuid
from typing import TYPE_CHECKING

from actx.schemas import layout as layout_lib
from actx.schemas import quantised
from actx.schemas import runspec as runspec_lib

if TYPE_CHECKING:  # imported where used: not every command opens a run
    from actx.schemas import run_dir

COUNT_INPUT_BYTES = 256 << 20  # inputs up to this size are counted whole by a dry prepare
ESTIMATE_DOCS = 2000  # documents per source the local estimate's timed worker may reach


@dataclasses.dataclass(frozen=True)
class Counts:
    """tokens / rows / partitions of the run; how they were found ("manifest", "counted").
    continued_from_rows: each partition's rows of a document continued from before it (of
    the manifest, or of the sample counted; None where the manifest has none): what the
    token-store reads of a model carrying context depend on (deploy.storage_plan)."""

    tokens: int
    rows: int
    partitions: int
    seq_len: int
    source: str
    continued_from_rows: tuple[int, ...] | None = None


def _continued_from_rows(manifest) -> tuple[int, ...] | None:
    from actx.schemas import manifest as manifest_lib

    try:
        return tuple(int(n) for n in manifest_lib.partition_column(manifest.partitions,
                                                                   "continued_from_rows"))
    except (AttributeError, KeyError, TypeError, ValueError):  # a manifest before version 4
        return None


def counts(spec: runspec_lib.RunSpec, run: "str | run_dir.RunDir") -> tuple[Counts | None, str]:
    """(the run's counts, "") or (None, why they are not known here), on every target:
    from the manifest of a run already prepared for this spec; else from a prepare of the
    inputs into memory, local or gs://: all of them up to `COUNT_INPUT_BYTES`, beyond that
    the first files of each source up to its share of that, scaled by bytes (an estimate,
    said so). A source with max_docs is read whole: its prepare stops there anyway."""
    from actx.pipeline import preflight as pipeline_preflight
    from actx.schemas import run_dir

    try:
        run = run_dir.RunDir.at(run)
        if run.is_prepared_for(spec):
            m = run.opened().manifest
            return Counts(m.total_tokens, m.total_rows, len(m.partitions), m.seq_len,
                          "from the run's manifest", _continued_from_rows(m)), ""
    except Exception:  # noqa: BLE001 - unreachable here: counted from the inputs
        pass
    try:
        files = pipeline_preflight.source_file_sizes(spec)
    except Exception as e:  # noqa: BLE001 - the pre-flight has said what is wrong
        return None, f"the inputs could not be listed ({e}); prepare counts them"
    total = sum(size for source in files for _, size in source)
    if total <= COUNT_INPUT_BYTES:
        return _counted(spec)
    # Each source alone: its first files up to its share of the budget, scaled by its own
    # bytes; a source with max_docs whole (its prepare stops there, whatever its size).
    tokens = rows = 0.0
    n_taken = taken = 0
    continued: list[int] | None = []
    free = sum(n for source, source_files in zip(spec.sources, files)
               if source.max_docs is None for _, n in source_files)
    for source, source_files in zip(spec.sources, files):
        size = sum(n for _, n in source_files)
        chosen = source_files if source.max_docs is not None else _leading(
            source_files, COUNT_INPUT_BYTES * size / max(1, free))
        part = sum(n for _, n in chosen)
        if source.max_docs is None and part > 2 * COUNT_INPUT_BYTES:
            return None, (f"the inputs are {total / 2**20:,.0f} MiB in files too large to "
                          f"sample (over {COUNT_INPUT_BYTES >> 20} MiB); prepare counts them")
        one = dataclasses.replace(source, paths=tuple(name for name, _ in chosen))
        found, why = _counted(dataclasses.replace(spec, sources=(one,)))
        if found is None:
            return None, why
        scale = 1.0 if source.max_docs is not None else size / max(1, part)
        tokens, rows = tokens + found.tokens * scale, rows + found.rows * scale
        continued = (None if continued is None or found.continued_from_rows is None
                     else continued + list(found.continued_from_rows))
        n_taken, taken = n_taken + len(chosen), taken + part
    rows = round(rows)
    return Counts(round(tokens), rows, math.ceil(rows / spec.layout.partition_rows),
                  spec.packing.seq_len,
                  f"estimated: {n_taken} of {sum(map(len, files))} input files "
                  f"({_size_text(taken)} of {_size_text(total)}) counted by a prepare into "
                  f"memory, scaled by bytes",
                  None if continued is None else tuple(continued)), ""


def _leading(files: list[tuple[str, int]], budget: float) -> list[tuple[str, int]]:
    """The first files whose sizes reach `budget` (at least one)."""
    chosen, size = [], 0
    for name, n in files:
        if chosen and size >= budget:
            break
        chosen.append((name, n))
        size += n
    return chosen


def _counted(spec: runspec_lib.RunSpec) -> tuple[Counts | None, str]:
    """A prepare into memory (in-process Beam runner): the manifest prepare would write."""
    import contextlib
    import io
    import logging

    from actx.pipeline import main as pipeline_main
    from actx.schemas import run_dir

    # A run in this process's memory, deleted after: the run itself is not touched.
    scratch = run_dir.RunDir.at(f"memory://actx-dry-run-{uuid.uuid4().hex}")
    quiet = logging.getLogger("actx.prepare")
    saved = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            m = pipeline_main.run_prepare_stoppable(spec, scratch, ["--runner=FnApiRunner"],
                                                    max_reject_fraction=1.0)
    except Exception as e:  # noqa: BLE001 - the dry run shows the plan anyway
        return None, f"a prepare into memory failed: {e}"
    finally:
        quiet.setLevel(saved)
        with contextlib.suppress(Exception):
            scratch.store.delete_prefix("")
    return Counts(m.total_tokens, m.total_rows, len(m.partitions), m.seq_len,
                  "counted by a prepare of the inputs into memory", _continued_from_rows(m)), ""


def hook_shapes(spec: runspec_lib.RunSpec):
    """The job's hooks ({hook: (values per token, stored dtype)}), the blocks the forward
    runs for them and the model's config, from the checkpoint's config.json by the workers'
    own rules, or why not (workers.preflight.HookShapes)."""
    from actx.workers import preflight as workers_preflight

    return workers_preflight.hook_shapes(spec)


def hook_bytes_per_row(spec: runspec_lib.RunSpec,
                       widths: dict[str, tuple[int, str]]) -> dict[str, int]:
    """Each hook's uncompressed bytes a row: seq_len x its width x its dtype's size."""
    return {name: spec.packing.seq_len * width * layout_lib.ITEMSIZE[dtype]
            for name, (width, dtype) in widths.items()}


def _size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def report(spec: runspec_lib.RunSpec, counted: tuple[Counts | None, str]) -> list[str]:
    """The cost lines of a dry run (each starts with "# "), given `counts`'s answer."""
    found, why = counted
    shapes = hook_shapes(spec)
    widths = shapes.hooks
    lines = ["# cost:"]
    if found is None:
        lines.append(f"#   tokens: not known here ({why})")
    else:
        lines.append(f"#   tokens: {found.tokens:,} in {found.rows:,} rows of {found.seq_len:,} "
                     f"({found.partitions:,} partitions; {found.source})")
        if spec.generate is not None:
            gen = spec.generate
            lines.append(f"#   generate: each prompt's {gen.samples_per_prompt} sample(s) hold "
                         f"its tokens and {gen.max_new_tokens:,} positions for the answer: "
                         f"the tokens above count both")
    if not widths:
        lines.append(f"#   activations: not known here ({shapes.why})")
        return lines
    shards_per_hook = (None if found is None
                       else math.ceil(found.rows / spec.layout.rows_per_shard))
    total = 0
    row_bytes = hook_bytes_per_row(spec, widths)
    for name, (width, dtype) in widths.items():
        per_row = row_bytes[name]
        if found is None:
            lines.append(f"#   {name}: {width} {dtype} values per token, "
                         f"{_size_text(per_row)} per row")
        else:
            total += per_row * found.rows
            lines.append(f"#   {name}: [{found.rows:,}, {found.seq_len:,}, {width}] {dtype} = "
                         f"{_size_text(per_row * found.rows)} in {shards_per_hook:,} objects")
    if found is not None:
        generates = spec.generate is not None  # a sample record beside each marker
        objects = len(widths) * (shards_per_hook + 1) + found.partitions * (1 + generates)
        hooks = sum(not quantised.is_scale_array(name) for name in widths)
        scales = (f" and their {len(widths) - hooks} float8 scale array(s)"
                  if len(widths) > hooks else "")
        lines.append(f"#   activations in all: {_size_text(total)} uncompressed in {hooks} "
                     f"hook(s){scales}; {objects:,} objects ({shards_per_hook:,} shards of "
                     f"{spec.layout.rows_per_shard} rows per hook, a zarr.json each, and "
                     f"{found.partitions:,} commit markers"
                     + (" and as many sample records" if generates else "") + ")")
    return lines


def estimate(spec: runspec_lib.RunSpec, counted: tuple[Counts | None, str], target,
             out, prices=None) -> None:
    """`--estimate`, given `counts`'s answer: on the local target, a time for the whole job
    from a short timed run of one worker process here (the target's batch, devices and
    model parallelism) over the first partitions of a small token store prepared in a
    temporary directory (the run itself is not touched): its steady-state rate (from its
    first tokens on, workers.loop.progress) times the job's replicas, plus its start-up. On
    another target, the least time its accelerators' peak allows (`_bound`): another
    target's hardware is not this machine's."""
    import dataclasses
    import shutil
    import subprocess
    import sys
    import tempfile
    import time

    found, why = counted
    if target.kind != "local":
        timed = _bound(spec, target, found, why, out)
        storage(spec, found, target, *(timed or (0.0, 0.0)), prices, out)
        return
    if found is None:
        print(f"# estimate: not made ({why})", file=out, flush=True)
        return
    from actx.deploy import local
    from actx.pipeline import main as pipeline_main
    from actx.schemas import run_dir

    tmp = tempfile.mkdtemp(prefix="actx-estimate-")
    timed = None  # (seconds, tokens/s of the job) once measured
    try:
        copy = run_dir.RunDir.at(os.path.join(tmp, "run"))  # a temporary copy, not the run
        import contextlib
        import io
        import logging

        logger = logging.getLogger("actx.prepare")
        saved = logger.level
        logger.setLevel(logging.WARNING)
        try:
            # The first documents of each source are enough for a few steps: the timed
            # worker never reaches more, and large inputs would take long to prepare.
            docs = max(ESTIMATE_DOCS, 16 * target.batch_size * target.hosts_per_replica)
            small = dataclasses.replace(spec, sources=tuple(
                dataclasses.replace(source, max_docs=min(source.max_docs or docs, docs))
                for source in spec.sources))
            with contextlib.redirect_stdout(io.StringIO()):
                pipeline_main.run_prepare_stoppable(small, copy, ["--runner=FnApiRunner"],
                                                    max_reject_fraction=1.0)
        finally:
            logger.setLevel(saved)
        manifest = copy.opened().manifest
        one = dataclasses.replace(target, hosts=target.hosts_per_replica)  # one replica
        ids, rows = [], 0
        for p in manifest.partitions:  # enough rows for a few steps after the first
            ids.append(p.id)
            rows += p.row_count
            if rows >= 4 * one.batch_size:
                break
        procs = [subprocess.Popen(
            [sys.executable, "-m", "actx.workers.main",
             *local.worker_args(copy.uri, one, small.fingerprint, "estimate", 0, i, coordinator,
                                ids)], env=local.worker_env(one), cwd=local.config_lib.code_path(),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for coordinator in [f"127.0.0.1:{local.free_port()}"
                                if one.hosts_per_replica > 1 else None]
            for i in range(one.hosts_per_replica)]
        started = time.time()
        errors = [p.communicate()[1] for p in procs]
        if any(p.returncode != 0 for p in procs):
            print(f"# estimate: the timed worker failed: {errors[0].strip()[-300:]}",
                  file=out, flush=True)
            return
        beat = next(hb for hb in copy.heartbeats()
                    if hb.host == local.host_name(0, 0))
        rate = beat.tokens_per_s
        first = next((t for t, n in beat.history if n > 0), None)
        if rate <= 0 or first is None:
            print("# estimate: not made (the timed partitions ran too few steps to measure "
                  "a steady rate)", file=out, flush=True)
            return
        startup = max(0.0, first - started)
        seconds = startup + found.tokens / (rate * target.replicas)
        timed = (seconds, rate * target.replicas)
        print(f"# estimate: about {_duration(seconds)} for {found.tokens:,} tokens: one "
              f"replica ran {rate:,.0f} tokens/s here in steady state (timed over "
              f"{len(ids)} partition(s) after a start-up of {_duration(startup)}), x "
              f"{target.replicas} replica(s) (if they do not slow each other on this "
              f"machine's cores)", file=out, flush=True)
    except Exception as e:  # noqa: BLE001 - a dry run's estimate is best effort
        print(f"# estimate: not made ({e})", file=out, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        # What the bucket sees does not depend on this machine's timing: said also when
        # the timed worker could not give a rate (then without the rates).
        storage(spec, found, target, *(timed or (0.0, 0.0)), prices, out)


def _bound(spec: runspec_lib.RunSpec, target, found: Counts | None, why: str,
           out) -> tuple[float, float] | None:
    """Another target's estimate: the least time its accelerators' peak allows (this
    machine's speed says nothing about the target's hardware; deploy.cost_bound), as
    (seconds, tokens/s) when known."""
    from actx.deploy import cost_bound

    if found is None:
        print(f"# estimate: not made ({why})", file=out, flush=True)
        return None
    peak, what = cost_bound.target_peak(target)
    if peak is None:
        print(f"# estimate: not made ({what})", file=out, flush=True)
        return None
    shapes = hook_shapes(spec)  # the blocks and sizes by the workers' rules, one read
    if shapes.config is None:
        print(f"# estimate: not made (the model's config.json: {shapes.why})", file=out,
              flush=True)
        return None
    blocks = shapes.blocks
    per_token = cost_bound.forward_flops_per_token(shapes.config, blocks, found.seq_len)
    seconds = found.tokens * per_token / peak
    print(f"# estimate: at least {_duration(seconds)} for {found.tokens:,} tokens on {what}: "
          f"{per_token / 1e9:,.2f} GFLOP per token over {blocks} block(s) at full peak; a "
          f"forward pass reaches a fraction of peak, which only a run on that hardware "
          f"measures", file=out, flush=True)
    return seconds, peak / per_token


def storage_job(spec: runspec_lib.RunSpec, found: Counts, target, seconds: float,
                tokens_per_s: float):
    """The job as deploy.storage_plan models it, for the target's hosts (None when the
    hooks' widths are not known here)."""
    from actx.deploy import storage_plan
    from actx.deploy import targets
    from actx.workers import preflight as workers_preflight

    shapes = hook_shapes(spec)
    widths = shapes.hooks
    if not widths:
        return None
    chosen = targets.as_target(target)
    hosts, replicas = chosen.hosts_and_replicas()
    cadences = workers_preflight.storage_cadences()
    return storage_plan.Job(
        rows=found.rows, partitions=found.partitions, seq_len=found.seq_len,
        hook_bytes_per_row=hook_bytes_per_row(spec, widths),
        rows_per_shard=spec.layout.rows_per_shard, partition_rows=spec.layout.partition_rows,
        # Beam's engine schedules the partitions: its workers take no claims.
        hosts=hosts, replicas=replicas, steal=target.steal and target.extract != "beam",
        heartbeat_s=target.heartbeat_s,
        log_every_s=chosen.log_every_s(), step_inputs=cadences.step_inputs,
        refresh_s=cadences.refresh_s, seconds=seconds, tokens_per_s=tokens_per_s,
        generates=spec.generate is not None,
        # A generating worker reads its prompts whole, with no warm-up of earlier rows.
        warmup_rows=(None if spec.generate is not None
                     else workers_preflight.warmup_rows(spec, shapes, found.seq_len)),
        continued_from_rows=found.continued_from_rows,
        continuation_inputs=cadences.continuation_inputs, cache_bytes=cadences.cache_bytes)


def storage(spec: runspec_lib.RunSpec, found: Counts | None, target, seconds: float,
            tokens_per_s: float, prices, out) -> None:
    """The estimate's storage lines (deploy.storage_plan) for the target's hosts: objects,
    bytes, requests by class and their price; with a time, the data's write rate against
    the bucket's and whether storage or compute bounds the job."""
    from actx.deploy import config as config_lib
    from actx.deploy import storage_plan

    job = None if found is None else storage_job(spec, found, target, seconds, tokens_per_s)
    if job is None:
        return
    lines = storage_plan.lines(job, prices or config_lib.StoragePrices())
    print("\n".join(lines), file=out, flush=True)


def _duration(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")

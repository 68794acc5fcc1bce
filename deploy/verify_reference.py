"""`actx verify RUN --reference`: recomputes a sample of stored documents with the model
itself and compares every stored hook.

A plain `actx verify` checks stored bytes against the checksums the workers wrote: it
cannot see a checkpoint whose conversion, dtype or configuration made actx compute
something else, nor values changed together with their checksums. This check can. Each
sampled document is run alone through HF transformers on PyTorch (deploy.hf_reference),
or for a Flax model through its module called eagerly (deploy.flax_reference), from its
first token, every token seeing what `tokens/context_start` says it saw (a
sliding window of packing.max_context past it); in `concat` runs a row is one causal
stream and is recomputed whole. Every stored hook of every stored token is compared. In a
generating run a sample's text is its prompt and the ids the model wrote
(deploy.verify_generated): the reference runs on that, the positions the sample did not
reach must hold zeros.

The sample: `--sample` distinct documents (default 4; all, if fewer), drawn by `--seed`
over the documents of the committed partitions (not partition by partition), the longest
of them first, one of them past max_context when the draw finds one (documents longer
than MAX_TOKENS are left out: HF would need a [tokens, tokens] mask). The error of a
token is |stored - reference| / |reference| (L2 over the hidden dimension; where
|reference| is below the document's median token norm, over that median: a hook near zero
at a token is not a relative mismatch); a hook's error is the worst over the sample,
checked against `tolerance(spec)`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Iterator

import numpy as np

from actx.deploy import hf_reference
from actx.deploy import verify_generated
from actx.reader import errors as reader_errors
from actx.reader import run as reader_run
from actx.schemas import activations_info as info_lib
from actx.schemas import advice
from actx.schemas import errors
from actx.schemas import layout
from actx.schemas import quantised
from actx.schemas import reference_verification as record_lib
from actx.schemas import store_errors

DEFAULT_SAMPLE = 4
MAX_TOKENS = 8192
# The worst relative error of a stored token against the float32 reference: what the
# compute dtype costs (float32: rounding through the layers; bfloat16: 8 bits of
# mantissa in every matmul input) and what storing rounds off (bfloat16 2^-9, float16
# 2^-12 per element), the larger of the two.
COMPUTE_TOLERANCE = {"float32": 1e-4, "bfloat16": 6e-2}
STORED_TOLERANCE = {"float32": 0.0, "float16": 2e-3, "bfloat16": 1e-2,
                    # float8 with per-token scales (schemas.quantised): half an ulp of
                    # e4m3's 3 mantissa bits, 2^-4 of each value, plus what values below its
                    # normal range round off (at most 2^-10 of the scale each, absmax / 448:
                    # below 6e-4 of the token's norm for any hidden size up to 2^16).
                    "float8_e4m3": quantised.FORMATS["float8_e4m3"].max_relative_error
                    + 6e-4}


class ReferenceCheckError(errors.UserError, ValueError):
    """The run cannot be checked against its model as asked."""


def tolerance(spec, compute_dtype: str | None = None) -> float:
    """The bound of a run's errors: its compute dtype's (spec.model.dtype, or a Flax
    model's own) and its stored dtype's, the larger."""
    return max(COMPUTE_TOLERANCE[compute_dtype or spec.model.dtype],
               STORED_TOLERANCE[spec.capture.dtype])


@dataclasses.dataclass
class _Reference:
    """What recomputes: compute(input_ids, context_start) -> {hook: [n, width]}."""

    described: str
    compute: object
    compute_dtype: str | None
    unknown: list


def _reference(spec, hooks: list[str], device: str) -> _Reference:
    if spec.model.flax:
        from actx.deploy import flax_reference

        ref = flax_reference.load(spec.model.flax)
        return _Reference(ref.described, lambda ids, context: flax_reference.hooks(
            ref, ids, hooks), ref.compute_dtype,
            [h for h in hooks if not flax_reference.supports(ref, h)])
    ref = hf_reference.load(spec.model.path, device)
    return _Reference(ref.described, lambda ids, context: hf_reference.hooks(
        ref, ids, context, hooks), None,
        [h for h in hooks if not hf_reference.supports(h, ref.num_layers)])


@dataclasses.dataclass(frozen=True)
class Unit:
    """What is recomputed at once: a document's tokens in order (rows / cols), or a
    `concat` row's. whole_stream: a concat row (context from its first column).
    prompt_tokens: in a generating run, where the sample's prompt ends (the doc table's;
    deploy.verify_generated); None otherwise."""

    what: str
    partition: int
    rows: np.ndarray
    cols: np.ndarray
    whole_stream: bool = False
    prompt_tokens: int | None = None


def _doc_table(run, pid: int) -> list[dict]:
    data = run.store.read(layout.docs_key(pid))
    return [json.loads(line) for line in (data or b"").decode().splitlines() if line.strip()]


def _document(run, doc: dict, pid: int) -> Unit:
    seq_len, n = run.seq_len, int(doc["n_tokens"])
    first = int(doc["first_row"])
    last = min(run.total_rows, first + (int(doc["first_col"]) + n - 1) // seq_len + 1)
    doc_index = run.token_array("doc_index")[first:last].read().result()
    r, c = np.nonzero(doc_index == int(doc["doc_index"]))
    if len(r) != n:
        raise ReferenceCheckError(
            f"{run.location}: document {doc['doc_id']!r} has {n} tokens in "
            f"{layout.docs_key(pid)} but {len(r)} in tokens/doc_index")
    prompt = doc.get("prompt_tokens") if run.spec.generate is not None else None
    sample = f", sample {doc['sample']}" if prompt is not None and "sample" in doc else ""
    return Unit(f"document {doc['doc_id']} (doc_index {doc['doc_index']}{sample})", pid,
                (r + first).astype(np.int64), c.astype(np.int64),
                prompt_tokens=None if prompt is None else int(prompt))


def _ordinals(total: int, rng) -> Iterator[int]:
    """0..total-1 in a seeded random order, each once: a permutation where it is small,
    else fresh draws that skip the ones seen (a run may hold 10^8 documents)."""
    if total <= PERMUTED_AT_MOST:
        yield from (int(i) for i in rng.permutation(total))
        return
    seen: set[int] = set()
    while len(seen) < total:
        i = int(rng.integers(total))
        if i not in seen:
            seen.add(i)
            yield i


PERMUTED_AT_MOST = 1 << 20


def sample(run, n: int, seed: int, only: set[int] | None,
           left_out: list[int] | None = None) -> list[Unit]:
    """The units to recompute: `n` distinct documents (all, if fewer) drawn uniformly by
    `seed` over the documents that start in committed partitions (`only`: these), each
    partition weighted by its documents (manifest `docs`), not partition by partition; the
    longest first. Where the packing carries context and none of them ran past
    max_context, the last is swapped for one that did, when the sample's order finds one.
    In a `concat` run a unit is a row (one causal stream), drawn over the committed rows.
    Documents over MAX_TOKENS are passed over; `left_out` gets the token count of each
    one the draw met (the caller says so).
    """
    committed = sorted(p for p in run.committed if only is None or p in only)
    if not committed:
        return []
    rng = np.random.default_rng(seed)
    if run.spec.packing.mode == "concat":
        return _rows(run, committed, n, rng)
    counts = np.asarray([run.partitions[p].docs for p in committed], np.int64)
    ends = np.cumsum(counts)
    tables: dict[int, list[dict]] = {}

    def doc_at(ordinal: int) -> tuple[dict, int] | None:
        k = int(np.searchsorted(ends, ordinal, side="right"))
        pid = committed[k]
        if pid not in tables:
            tables[pid] = _doc_table(run, pid)
        index = ordinal - (int(ends[k - 1]) if k else 0)
        table = tables[pid]
        return (table[index], pid) if index < len(table) else None

    packing = run.spec.packing
    past_at = packing.max_context if packing.carries_context else None
    chosen, order = [], _ordinals(int(ends[-1]) if len(ends) else 0, rng)
    for ordinal in order:
        found = doc_at(ordinal)
        if found is not None and int(found[0]["n_tokens"]) > MAX_TOKENS:
            if left_out is not None:
                left_out.append(int(found[0]["n_tokens"]))
        elif found is not None:
            chosen.append(found)
            if len(chosen) == n:
                break
    if past_at and chosen and not any(int(d["n_tokens"]) > past_at for d, _ in chosen):
        # Past max_context is where a sliding window matters: one such document, looked
        # for among at most PAST_LOOKS more of the same order.
        for _, ordinal in zip(range(PAST_LOOKS), order):
            found = doc_at(ordinal)
            if found is not None and past_at < int(found[0]["n_tokens"]) <= MAX_TOKENS:
                chosen[-1] = found
                break
    if not chosen:
        return []
    longest = max(range(len(chosen)), key=lambda i: (int(chosen[i][0]["n_tokens"]), -i))
    ordered = [chosen[longest]] + [c for i, c in enumerate(chosen) if i != longest]
    return [_document(run, doc, pid) for doc, pid in ordered]


PAST_LOOKS = 4096


def _rows(run, committed: list[int], n: int, rng) -> list[Unit]:
    """`n` distinct rows holding tokens (all, if fewer), drawn uniformly over the rows of
    the committed partitions."""
    starts = [run.partitions[p].row_start for p in committed]
    ends = np.cumsum([run.partitions[p].row_count for p in committed])
    units = []
    for ordinal in _ordinals(int(ends[-1]), rng):
        k = int(np.searchsorted(ends, ordinal, side="right"))
        row = starts[k] + ordinal - (int(ends[k - 1]) if k else 0)
        seg = run.token_array("segment_ids")[row].read().result()
        cols = np.flatnonzero(seg > 0).astype(np.int64)
        if len(cols):
            units.append(Unit(f"row {row}", committed[k], np.full(len(cols), row, np.int64),
                              cols, whole_stream=True))
            if len(units) == n:
                break
    return units


def _errors(stored: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Per token: |stored - reference| / max(|reference|, median |reference|)."""
    diff = np.linalg.norm(stored.astype(np.float64) - reference, axis=-1)
    norm = np.linalg.norm(reference.astype(np.float64), axis=-1)
    floor = max(float(np.median(norm)), 1e-30)
    return diff / np.maximum(norm, floor)


def check(handle, n: int = DEFAULT_SAMPLE, device: str = "cpu", seed: int = 0,
          only: set[int] | None = None, at: float | None = None,
          log=None) -> record_lib.ReferenceRecord:
    """Recomputes `n` sampled units of the run (`handle`: schemas.run_dir.OpenedRun) and
    returns the record of what was found."""
    spec = handle.spec
    if n < 1:
        raise ReferenceCheckError(f"--sample {n}: recompute at least 1 document")
    if not spec.model.flax:
        hf_reference.require_torch()
    run = reader_run.Run(handle.store, spec, handle.manifest,
                         extraction=getattr(handle.store, "name", ""))
    left_out: list[int] = []
    units = sample(run, n, seed, only, left_out)
    if not units and left_out:
        raise ReferenceCheckError(
            f"{handle.location}: every committed document drawn is longer than "
            f"{MAX_TOKENS:,} tokens (the longest {max(left_out):,}), which the reference "
            f"does not recompute (it computes a document whole, with a [tokens, tokens] "
            f"attention mask)" + (" in the partitions --only names" if only else ""))
    if not units:
        raise ReferenceCheckError(f"{handle.location}: no committed document to recompute"
                                  + (" in the partitions --only names" if only else "")
                                  + f"; extract first (`{advice.rerun(handle.location)}`)")
    if left_out and log is not None:
        print(f"verify --reference: {len(left_out)} document(s) of the draw are longer than "
              f"{MAX_TOKENS:,} tokens (the longest {max(left_out):,}) and were passed over: "
              f"the reference computes a document whole, with a [tokens, tokens] attention "
              f"mask; shorter ones stand in their place", file=log, flush=True)
    # A router's hooks (mixtures of experts) have no counterpart in the references' hook
    # points; the layer's mlp_out, which the chosen experts make, is compared.
    not_recomputed = tuple(h for h in sorted(run.hooks) if h.rsplit(".", 1)[-1] in info_lib.ROUTER_POINTS)
    hooks = [h for h in sorted(run.hooks) if h not in not_recomputed]
    if not hooks:
        raise ReferenceCheckError(f"hooks {list(not_recomputed)}: a router's hooks only, which "
                                  f"the reference does not recompute; store a layer's "
                                  f"mlp_out or resid_post beside them to check the run")
    ref = _reference(spec, hooks, device)
    if ref.unknown:
        raise ReferenceCheckError(f"hooks {ref.unknown}: not hooks of the model "
                                  f"{spec.model.flax or spec.model.path}")
    bound = tolerance(spec, ref.compute_dtype)
    committed = set(run.committed)
    row_starts = np.asarray([p.row_start for p in run.partitions])
    worst: dict[str, float] = {h: 0.0 for h in hooks}
    checked, failures = [], []
    for unit in units:
        # Prepare wrote every token: those of a partition not committed yet are read too.
        tokens = {name: run.token_array(name).vindex[unit.rows, unit.cols].read().result()
                  for name in ("input_ids", "positions", "context_start")}
        n_tokens = len(unit.rows)
        where = f"{unit.what} (partition {layout.partition_name(unit.partition)})"
        want_positions = unit.cols if unit.whole_stream else np.arange(n_tokens)
        if not np.array_equal(tokens["positions"], want_positions):
            failures.append(f"{where}: stored positions are not 0..{n_tokens - 1}")
            continue
        context = (np.zeros(n_tokens, np.int64) if unit.whole_stream
                   else tokens["context_start"].astype(np.int64))
        # Only tokens of committed partitions hold values (a document may run on).
        pids = np.searchsorted(row_starts, unit.rows, side="right") - 1
        keep = np.isin(pids, list(committed))
        try:  # an object lost since its commit would read as zeros: that is the finding
            run.require_stored(hooks, [run.partitions[int(p)] for p in sorted(set(pids[keep]))])
        except reader_errors.LostDataError as e:
            failures.append(f"{where}: {e}")
            continue
        ids, end, said = tokens["input_ids"], n_tokens, ""
        if unit.prompt_tokens is not None:  # a sample: its prompt, then what was generated
            text = verify_generated.sample_text(
                ids, verify_generated.generated_ids(run, unit.rows, unit.cols), keep,
                unit.prompt_tokens)
            failures += [f"{where}: {p}" for p in text.problems]
            failures += _unused_not_zero(run, hooks, unit, text.unused, where)
            ids, end = text.input_ids, text.end
            keep = keep & (np.arange(n_tokens) < end)
            said = (f" ({unit.prompt_tokens} prompt + {text.generated} generated; "
                    f"{int(text.unused.sum())} unreached, zero)")
        started = time.monotonic()
        reference = ref.compute(ids[:end], context[:end])
        stored = run.gather(hooks, unit.rows[keep], unit.cols[keep])
        per_hook = {}
        for hook in hooks:
            errs = _errors(stored[hook].astype(np.float32), reference[hook][keep[:end]])
            per_hook[hook] = float(errs.max()) if len(errs) else 0.0
            worst[hook] = max(worst[hook], per_hook[hook])
            if per_hook[hook] > bound or not np.isfinite(per_hook[hook]):
                worst_at = int(np.argmax(np.where(np.isfinite(errs), errs, np.inf)))
                token = int(np.flatnonzero(keep)[worst_at])
                failures.append(
                    f"{where}, hook {hook}: relative error {per_hook[hook]:.3g} > tolerance "
                    f"{bound:.2g} (worst at token {token} of {n_tokens}, row "
                    f"{int(unit.rows[token])} column {int(unit.cols[token])})")
        checked.append(record_lib.CheckedDocument(
            unit.what, layout.partition_name(unit.partition), int(keep.sum()),
            int((context[keep] > 0).sum()), per_hook))
        if log is not None:
            print(f"recomputed {unit.what}: {end} tokens{said} in "
                  f"{time.monotonic() - started:.1f}s", file=log, flush=True)
    return record_lib.ReferenceRecord(
        at=time.time() if at is None else at, ok=not failures, reference=ref.described,
        seed=seed, sample=n, tolerance=bound, hooks=worst, documents=tuple(checked),
        failures=tuple(failures), not_recomputed=not_recomputed)


def _unused_not_zero(run, hooks: list[str], unit: Unit, unused: np.ndarray,
                     where: str) -> list[str]:
    """A failure per hook whose values at the positions a sample did not reach (`unused`,
    in committed partitions) are not all exactly zero, as the worker writes them."""
    if not unused.any():
        return []
    stored = run.gather(hooks, unit.rows[unused], unit.cols[unused])
    found = []
    for hook in hooks:
        nonzero = np.flatnonzero(np.any(stored[hook] != 0, axis=-1))
        if len(nonzero):
            token = int(np.flatnonzero(unused)[nonzero[0]])
            found.append(
                f"{where}, hook {hook}: {len(nonzero)} of the {int(unused.sum())} position(s) "
                f"the sample did not reach ({layout.GENERATED_IDS} "
                f"{layout.GENERATED_UNUSED}) hold nonzero values, which must be zero (first "
                f"at token {token}, row {int(unit.rows[token])} column "
                f"{int(unit.cols[token])})")
    return found


def render(record: record_lib.ReferenceRecord, run: str) -> str:
    lines = [f"verify --reference {run}: {record_lib.units(record)} recomputed with "
             f"{record.reference} (seed {record.seed})"]
    for doc in record.documents:
        past = f", {doc.past_max_context} past max_context" if doc.past_max_context else ""
        lines.append(f"  {doc.what}: partition {doc.partition}, {doc.tokens} tokens{past}")
    lines.append(f"  {'hook':<28} {'worst relative error':>20} {'tolerance':>10}")
    for hook, err in record.hooks.items():
        lines.append(f"  {hook:<28} {err:>20.3g} {record.tolerance:>10.2g}")
    if record.not_recomputed:
        lines.append(f"  not recomputed (no reference counterpart): "
                     f"{', '.join(record.not_recomputed)}")
    if record.ok:
        lines.append("OK: every stored value of the sample equals the model's own, within "
                     "tolerance")
    else:
        lines.append(f"FAILED: {len(record.failures)} (document, hook) pair(s) out of "
                     f"tolerance:")
        lines += [f"  {f}" for f in record.failures]
    return "\n".join(lines)


def command(handle, only: set[int] | None, args, out) -> int:
    """`actx verify RUN --reference`: prints and records the check; 1 when out of
    tolerance."""
    if args.repair:
        raise ReferenceCheckError("--repair and --reference: a value out of tolerance is not "
                                  "damage a rerun repairs (the same model computes it "
                                  "again); run them separately")
    record = check(handle, args.sample, args.device, args.seed, only,
                   log=None if args.json else out)
    if args.json:
        from actx.schemas import config as config_lib

        print(json.dumps(config_lib.to_dict(record), indent=1, sort_keys=True), file=out)
    else:
        print(render(record, str(handle.location)), file=out)
    try:
        record_lib.write_record(handle.store, record)
    except store_errors.StoreError as e:
        print(f"actx verify: the report above was not recorded: {e}", file=sys.stderr)
    return 0 if record.ok else 1

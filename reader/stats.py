"""Per-hook running statistics (mean, variance, mean L2 norm) for normalising activations.

One streaming pass over the valid tokens of committed partitions, one stored object
(rows_per_shard rows) at a time, merged with Chan et al.'s parallel update in float64 so
the result does not depend on block sizes. Stored in the run under layout.STATS_KEY, keyed
by hook, with the partitions and exclusions they cover.

The same pass feeds the token masks (reader.masks) from the activations it already holds:
every token's norm is stored beside the hook (layout.norms_array_key, one write per
partition), the median norm comes from a histogram of log2 norms (bins of 1/NORM_BINS_PER_
OCTAVE octave: within 0.14% of the exact median), and the tokens each mask removes are
counted (stats.json "masks", shown by run.describe()).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from actx.reader import masks as masks_lib
from actx.reader import snapshot
from actx.reader.stored_stats import HookStats
from actx.schemas import layout
from actx.schemas import object_store
from actx.schemas import ts_context

NORM_BINS_PER_OCTAVE = 256
_LOG2_RANGE = (-64.0, 64.0)  # norms outside 2^-64..2^64 fall in the end bins


class _Running:
    """Count, mean and sum of squared deviations (M2), merged block by block."""

    def __init__(self, hidden: int):
        self.count = 0
        self.mean = np.zeros(hidden, np.float64)
        self.m2 = np.zeros(hidden, np.float64)
        self.norm_sum = 0.0
        bins = int((_LOG2_RANGE[1] - _LOG2_RANGE[0]) * NORM_BINS_PER_OCTAVE)
        self.norm_hist = np.zeros(bins, np.int64)

    def add(self, x: np.ndarray, norms: np.ndarray) -> None:
        if not len(x):
            return
        x = x.astype(np.float64)
        with np.errstate(divide="ignore"):
            at = (np.log2(norms) - _LOG2_RANGE[0]) * NORM_BINS_PER_OCTAVE
        at = np.clip(np.nan_to_num(at, neginf=0), 0, len(self.norm_hist) - 1)
        self.norm_hist += np.bincount(at.astype(np.int64), minlength=len(self.norm_hist))
        n_b = len(x)
        mean_b = x.mean(axis=0)
        m2_b = ((x - mean_b) ** 2).sum(axis=0)
        n = self.count + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self.m2 = self.m2 + m2_b + delta**2 * (self.count * n_b / n)
        self.count = n
        self.norm_sum += float(norms.sum())

    def median_norm(self) -> float:
        """The median norm: the geometric middle of the histogram bin holding it."""
        if not self.count:
            return float("nan")
        b = int(np.searchsorted(np.cumsum(self.norm_hist), (self.count + 1) / 2))
        return float(2 ** (_LOG2_RANGE[0] + (b + 0.5) / NORM_BINS_PER_OCTAVE))


def compute_stats(run: snapshot.RunSnapshot, hooks: Sequence[str] | None = None, *,
                  exclude: Sequence[str] | None = None,
                  partitions: Sequence[int] | None = None, exclude_bos: bool = False,
                  exclude_special: bool = False, write: bool = True,
                  outlier_factor: float = masks_lib.DEFAULT_OUTLIER_FACTOR
                  ) -> dict[str, HookStats]:
    """Streams every selected token once (all hooks per block) and, when `write`, stores
    the result in the run's stats.json (other hooks' entries are kept), each token's norm
    per hook (the "outlier" mask) and the tokens each mask removes (counted with
    `outlier_factor`; see reader.masks). On a live run they cover what has committed
    (`partitions`), and the record says so (run_partitions, complete: False).

    exclude: the mask reasons whose tokens the statistics leave out, as a stream's
    `exclude=` names them (padding always): a stream that normalises (`normalize=`) with
    statistics of the tokens it serves asks for the same ones. "outlier" is not one: its
    threshold is these statistics' median norm."""
    reasons = masks_lib.check_roles(masks_lib.check_exclude(exclude), run)
    if "outlier" in reasons:
        raise ValueError("exclude: 'outlier' cannot be left out of the statistics that "
                         "define it (its threshold is their median norm); name the others")
    hooks = tuple(run.hooks) if hooks is None else run.resolve_hooks(tuple(hooks))
    ids = run.committed_ids(partitions, hooks)
    running = {h: _Running(run.hook(h).hidden) for h in hooks}
    block = run.spec.layout.rows_per_shard  # one stored object per read
    counted = masks_lib.TokenFilter(run.manifest.bos_id, tuple(run.manifest.special_token_ids),
                                    run.spec.packing.mode == "concat", exclude=reasons,
                                    exclude_bos=exclude_bos, exclude_special=exclude_special,
                                    generates=run.spec.generate is not None)
    every = dataclasses.replace(counted, exclude=masks_lib.TOKEN_REASONS, exclude_bos=False,
                                exclude_special=False, generates=False)
    names = every.names
    removed = dict.fromkeys(masks_lib.TOKEN_REASONS, 0)
    norm_arrays = ({h: ts_context.open_array(dataclasses.replace(layout.norms_array(
        h, run.total_rows, run.seq_len, run.spec.layout), key=run.stored_key(
            layout.norms_array_key(h))).spec(run.location, create=True))
        for h in hooks} if write else {})
    norms_of = {}  # hook -> [partition rows, T] float32: every token's norm, per partition
    for pid in ids:
        part = run.partitions[pid]
        norms_of = {h: np.zeros((part.row_count, run.seq_len), np.float32) for h in hooks}
        for lo in range(part.row_start, part.row_stop, block):
            hi = min(lo + block, part.row_stop)
            toks = [run.token_array(n)[lo:hi].read() for n in names]
            if counted.generates:  # its unused reserved positions count as padding
                toks.append(run.open_array(layout.activation_array_key(
                    layout.GENERATED_IDS))[lo:hi].read())
            # Dequantised where a hook is float8: statistics of the values readers return.
            acts = {h: run.read_async(h, lambda a: a[lo:hi]) for h in hooks}
            values = [f.result() for f in toks]
            arrays = dict(zip(names, values))  # the token arrays (zip stops at names)
            # The counted tokens' arrays by name (`every` reads each array they need).
            mask = counted.keep([arrays[n] for n in counted.names] + values[len(names):])
            for reason, m in masks_lib.token_reasons(
                    arrays, every.bos_id, every.special_ids, every.concat).items():
                removed[reason] += int(m.sum())
            for h, fut in acts.items():
                x = fut.result()
                # float64, as the statistics are (the stored norms are float32).
                norms = np.linalg.norm(x.astype(np.float64), axis=-1)
                norms[arrays["segment_ids"] == 0] = 0
                norms_of[h][lo - part.row_start:hi - part.row_start] = norms
                running[h].add(x[mask], norms[mask])
        writes = [norm_arrays[h][part.row_start:part.row_stop].write(norms_of[h])
                  for h in norm_arrays]
        for w in writes:
            w.result()
    result = {}
    for h, r in running.items():
        var = r.m2 / r.count if r.count else np.full_like(r.mean, np.nan)
        mean_norm = r.norm_sum / r.count if r.count else float("nan")
        result[h] = HookStats(h, r.count, r.mean, var, mean_norm, ids, exclude_bos,
                              exclude_special, r.median_norm(), ids if write else (),
                              len(run.partitions), reasons)
    if write:
        outliers = {h: _count_outliers(norm_arrays[h], run, ids, outlier_factor * s.norm_median)
                    for h, s in result.items()}
        try:
            data = run.store.read_json(layout.STATS_KEY) or {}
        except object_store.DamagedObjectError:  # derived data: written anew, this call's
            data = {}
        data.setdefault("hooks", {})
        data["fingerprint"] = run.spec.fingerprint
        data["updated_at"] = time.time()
        for h, s in result.items():
            data["hooks"][h] = s.to_json_obj()
        data["masks"] = {
            "version": layout.MASKS_VERSION, "partitions": list(ids),
            "positions": int(sum(run.partitions[p].row_count for p in ids)) * run.seq_len,
            "removed": removed, "outlier_factor": outlier_factor,
            "outlier": {**data.get("masks", {}).get("outlier", {}), **outliers}}
        run.store.write_json(layout.STATS_KEY, data)
    return result


def _count_outliers(norms, run: snapshot.RunSnapshot, ids: Sequence[int], limit: float) -> int:
    """Tokens of `ids` whose stored norm is above `limit` (a re-read of 4 bytes per
    position, after the median is known)."""
    total = 0
    for pid in ids:
        part = run.partitions[pid]
        total += int((norms[part.row_start:part.row_stop].read().result() > limit).sum())
    return total

"""Per-hook running statistics (mean, variance, mean L2 norm) for normalising activations.

One streaming pass over the valid tokens of committed partitions, one stored object
(rows_per_shard rows) at a time, merged with Chan et al.'s parallel update in float64 so
the result does not depend on block sizes. Stored in the run under layout.STATS_KEY, keyed
by hook, with the partitions and exclusions they cover.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from reader import errors
from reader import run as run_lib
from reader import shuffle as shuffle_lib
from schemas import layout

STATS_VERSION = 1


@dataclasses.dataclass(frozen=True)
class HookStats:
    """Statistics of one hook over `count` tokens.

    mean / var: per hidden dimension (float64 [hidden]); var is the population variance.
    mean_norm: mean L2 norm of a token's activation vector.
    partitions: the committed partitions covered; exclude_bos / exclude_special: which
    tokens were left out besides padding.
    """

    hook: str
    count: int
    mean: np.ndarray
    var: np.ndarray
    mean_norm: float
    partitions: tuple[int, ...]
    exclude_bos: bool = False
    exclude_special: bool = False

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.var)

    def to_json_obj(self) -> dict:
        return {"count": self.count, "mean": self.mean.tolist(), "var": self.var.tolist(),
                "mean_norm": self.mean_norm, "partitions": list(self.partitions),
                "exclude_bos": self.exclude_bos, "exclude_special": self.exclude_special,
                "version": STATS_VERSION}

    @classmethod
    def from_json_obj(cls, hook: str, data: dict) -> "HookStats":
        return cls(hook, int(data["count"]), np.asarray(data["mean"], np.float64),
                   np.asarray(data["var"], np.float64), float(data["mean_norm"]),
                   tuple(data["partitions"]), bool(data.get("exclude_bos", False)),
                   bool(data.get("exclude_special", False)))


class _Running:
    """Count, mean and sum of squared deviations (M2), merged block by block."""

    def __init__(self, hidden: int):
        self.count = 0
        self.mean = np.zeros(hidden, np.float64)
        self.m2 = np.zeros(hidden, np.float64)
        self.norm_sum = 0.0

    def add(self, x: np.ndarray) -> None:
        if not len(x):
            return
        x = x.astype(np.float64)
        n_b = len(x)
        mean_b = x.mean(axis=0)
        m2_b = ((x - mean_b) ** 2).sum(axis=0)
        n = self.count + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self.m2 = self.m2 + m2_b + delta**2 * (self.count * n_b / n)
        self.count = n
        self.norm_sum += float(np.linalg.norm(x, axis=1).sum())


def compute_stats(run: run_lib.Run, hooks: Sequence[str] | None = None, *,
                  partitions: Sequence[int] | None = None, exclude_bos: bool = False,
                  exclude_special: bool = False, write: bool = True) -> dict[str, HookStats]:
    """Streams every selected token once (all hooks per block) and, when `write`, stores
    the result in the run's stats.json (other hooks' entries are kept)."""
    hooks = tuple(run.hooks) if hooks is None else tuple(hooks)
    ids = run.committed_ids(partitions, hooks)
    running = {h: _Running(run.hook(h).hidden) for h in hooks}
    block = run.spec.layout.rows_per_shard  # one stored object per read
    m = run.manifest
    for pid in ids:
        part = run.partitions[pid]
        for lo in range(part.row_start, part.row_stop, block):
            hi = min(lo + block, part.row_stop)
            toks = [run.token_array(n)[lo:hi].read() for n in ("segment_ids", "input_ids")]
            acts = {h: run.activation_array(h)[lo:hi].read() for h in hooks}
            seg, inp = (f.result() for f in toks)
            mask = shuffle_lib.valid_mask(seg, inp, m.bos_id, m.special_token_ids,
                                          exclude_bos, exclude_special)
            for h, fut in acts.items():
                running[h].add(fut.result()[mask])
    result = {}
    for h, r in running.items():
        var = r.m2 / r.count if r.count else np.full_like(r.mean, np.nan)
        mean_norm = r.norm_sum / r.count if r.count else float("nan")
        result[h] = HookStats(h, r.count, r.mean, var, mean_norm, ids, exclude_bos,
                              exclude_special)
    if write:
        data = run.store.read_json(layout.STATS_KEY) or {}
        data.setdefault("hooks", {})
        data["fingerprint"] = run.spec.fingerprint
        data["updated_at"] = time.time()
        for h, s in result.items():
            data["hooks"][h] = s.to_json_obj()
        run.store.write_json(layout.STATS_KEY, data)
    return result


def load_stats(run: run_lib.Run, hook: str) -> HookStats:
    """Stored statistics of `hook`; a clear error when none were computed."""
    data = run.store.read_json(layout.STATS_KEY) or {}
    entry = data.get("hooks", {}).get(hook)
    if entry is None:
        run.hook(hook)  # unknown hook: say so, listing the hooks
        raise errors.ReaderError(
            f"{run.location.join(layout.STATS_KEY)}: no statistics for hook {hook!r}; "
            f"compute them with reader.open_run(...).compute_stats([{hook!r}])")
    stats = HookStats.from_json_obj(hook, entry)
    stale = set(stats.partitions) - set(run.committed)
    if stale:  # cannot happen for create-only markers, but a hand-edited run could
        raise errors.ReaderError(f"{run.location}: statistics of {hook!r} cover partitions "
                                 f"{sorted(stale)} that are not committed; recompute them")
    return stats

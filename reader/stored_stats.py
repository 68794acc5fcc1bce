"""Statistics a run holds (stats.json, written by reader.stats.compute_stats): per hook
mean / variance / norms (`HookStats`), and the tokens each mask removes.

Read by the normalizers (reader.formats), the "outlier" mask (reader.masks) and
`run.describe()`; kept apart from the pass that computes them, which reads through those.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from actx.reader import errors
from actx.reader import snapshot
from actx.schemas import config as config_lib
from actx.schemas import layout
from actx.schemas import object_store
from actx.schemas import token_masks

STATS_VERSION = 1


@dataclasses.dataclass(frozen=True)
class HookStats:
    """Statistics of one hook over `count` tokens.

    mean / var: per hidden dimension (float64 [hidden]); var is the population variance.
    mean_norm: mean L2 norm of a token's activation vector.
    partitions: the committed partitions covered; exclude_bos / exclude_special: which
    tokens were left out besides padding; exclude: the readers' mask reasons left out
    (`compute_stats(exclude=...)`, as a stream's `exclude=`; () in statistics stored
    before it was).
    run_partitions: the run's partitions when they were computed (0: not recorded, in
    statistics stored before it was); fewer covered (a live run's compute_stats covers
    what had committed): `complete` is False, and the record says so.
    """

    hook: str
    count: int
    mean: np.ndarray
    var: np.ndarray
    mean_norm: float
    partitions: tuple[int, ...]
    exclude_bos: bool = False
    exclude_special: bool = False
    norm_median: float = float("nan")  # median L2 norm of the tokens counted
    norm_partitions: tuple[int, ...] = ()  # partitions whose per-token norms are stored
    run_partitions: int = 0
    exclude: tuple[str, ...] = ()

    def left_out(self) -> frozenset[str]:
        """What these statistics do not count, as `left_out` names it."""
        return left_out(self.exclude, self.exclude_bos, self.exclude_special)

    @property
    def complete(self) -> bool | None:
        """Whether they cover every partition of the run (None: not recorded)."""
        return None if not self.run_partitions else len(self.partitions) >= self.run_partitions

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.var)

    def to_json_obj(self) -> dict:
        return {"count": self.count, "mean": self.mean.tolist(), "var": self.var.tolist(),
                "mean_norm": self.mean_norm, "partitions": list(self.partitions),
                "exclude_bos": self.exclude_bos, "exclude_special": self.exclude_special,
                "norm_median": self.norm_median,
                "norm_partitions": list(self.norm_partitions), "version": STATS_VERSION,
                **({"exclude": list(self.exclude)} if self.exclude else {}),
                **({"run_partitions": self.run_partitions, "complete": self.complete}
                   if self.run_partitions else {})}

    @classmethod
    def from_json_obj(cls, hook: str, data: dict) -> "HookStats":
        return cls(hook, int(data["count"]), np.asarray(data["mean"], np.float64),
                   np.asarray(data["var"], np.float64), float(data["mean_norm"]),
                   tuple(data["partitions"]), bool(data.get("exclude_bos", False)),
                   bool(data.get("exclude_special", False)),
                   float(data.get("norm_median", float("nan"))),
                   tuple(data.get("norm_partitions", ())), int(data.get("run_partitions", 0)),
                   tuple(data.get("exclude", ())))


def left_out(exclude: tuple[str, ...], exclude_bos: bool, exclude_special: bool
             ) -> frozenset[str]:
    """The tokens a reader (or statistics) leaves out besides padding, by name: the mask
    reasons of `exclude` (checked) but "outlier" (no statistics can leave out what their
    median defines), and the older switches as their keywords ("exclude_bos": the BOS id
    alone, unlike the "bos" reason; "exclude_special")."""
    return frozenset(set(exclude) - {"padding", "outlier"}
                     | ({"exclude_bos"} if exclude_bos else set())
                     | ({"exclude_special"} if exclude_special else set()))


def load_masks(run: snapshot.RunSnapshot) -> dict | None:
    """The mask counts stored by compute_stats (`schemas.token_masks.MaskCounts` as a
    dict; None before it ran)."""
    try:
        counts = token_masks.read_mask_counts(run.store)
    except object_store.DamagedObjectError:  # load_stats says so, with what mends it
        return None
    return None if counts is None else config_lib.to_dict(counts)


def compute_call(hooks, served: frozenset[str] = frozenset()) -> str:
    """The arguments of the `compute_stats` call whose statistics count the tokens a
    reader that leaves out `served` (`left_out`) serves."""
    reasons = sorted(served - {"exclude_bos", "exclude_special"})
    return ", ".join([repr(list(hooks))] + ([f"exclude={reasons!r}"] if reasons else [])
                     + [f"{k}=True" for k in sorted(served & {"exclude_bos",
                                                              "exclude_special"})])


def load_stats(run: snapshot.RunSnapshot, hook: str,
               served: frozenset[str] = frozenset(), wanted=None) -> HookStats:
    """Stored statistics of `hook`; a clear error when none were computed, naming the call
    that computes them, for every hook of `wanted` (default: `hook`) that has none, over
    the tokens a reader leaving out `served` serves."""
    try:
        data = run.store.read_json(layout.STATS_KEY) or {}
    except object_store.DamagedObjectError as e:  # derived data: computed again
        raise errors.ReaderError(
            f"{run.location.join(run.stored_key(layout.STATS_KEY))}: {e.what}: the run's "
            f"statistics are damaged; compute them again with {run.open_call()}"
            f".compute_stats({compute_call(wanted or [hook], served)}), which writes it "
            f"anew") from None
    entry = data.get("hooks", {}).get(hook)
    if entry is None:
        run.hook(hook)  # unknown hook: say so, listing the hooks
        missing = [h for h in (wanted or [hook]) if h not in data.get("hooks", {})]
        raise errors.ReaderError(
            f"{run.location.join(run.stored_key(layout.STATS_KEY))}: no statistics for "
            f"{'hook' if len(missing) == 1 else 'hooks'} {', '.join(map(repr, missing))}; "
            f"compute them with {run.open_call()}.compute_stats("
            f"{compute_call(missing, served)})")
    stats = HookStats.from_json_obj(hook, entry)
    stale = set(stats.partitions) - set(run.committed)
    if stale:  # cannot happen for create-only markers, but a hand-edited run could
        raise errors.ReaderError(f"{run.location}: statistics of {hook!r} cover partitions "
                                 f"{sorted(stale)} that are not committed; recompute them")
    return stats

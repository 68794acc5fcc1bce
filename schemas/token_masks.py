"""What the token masks remove: stats.json's "masks" entry, written by the reader's
`compute_stats` and read by `run.describe()`, `actx status` and the live page.

One definition of its fields, so the reader that writes it and the ops that show it agree.
"""

from __future__ import annotations

import dataclasses

from actx.schemas import config as config_lib
from actx.schemas import layout


@dataclasses.dataclass(frozen=True)
class MaskCounts:
    """version: layout.MASKS_VERSION when written. partitions: the committed partitions
    counted. positions: token positions of those partitions (rows x seq_len). removed: per
    token mask (special, bos, padding, doc_boundary), positions it leaves out. outlier_factor:
    a token is an outlier above this many times its hook's median norm. outlier: per hook,
    the tokens it leaves out as outliers."""

    version: int
    partitions: tuple[int, ...]
    positions: int
    removed: dict[str, int]
    outlier_factor: float
    outlier: dict[str, int] = dataclasses.field(default_factory=dict)


def read_mask_counts(store) -> MaskCounts | None:
    """The counts, None before `compute_stats` ran. A damaged entry raises ConfigError
    naming the key and field."""
    masks = (store.read_json(layout.STATS_KEY) or {}).get("masks")
    if masks is None:
        return None
    return config_lib.from_dict(MaskCounts, masks,
                                f"{store.location.join(layout.STATS_KEY)}: masks.")

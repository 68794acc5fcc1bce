"""Where a stream stands, to resume it: a typed, versioned object with a JSON form.

`ShuffledStream.resume_state(batch)` gives a `StreamState`; `state(batch)` gives its JSON
form (`to_dict`, the plain dict training jobs save next to their checkpoints), and
`resume=` takes either. The order of a stream depends only on the settings recorded
here, so a state resumes only a stream opened with the same ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any

STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class StreamSettings:
    """What fixes a stream's order. A field is None where a saved state lacks it
    (`exclude` and `outlier_factor` are recorded only when a mask is used, so states
    saved before masks existed still load)."""

    fingerprint: str | None = None
    hooks: tuple[str, ...] | None = None
    partitions: tuple[int, ...] | None = None
    batch_size: int | None = None
    buffer_rows: int | None = None
    block_rows: int | None = None
    seed: int | None = None
    process_index: int | None = None
    process_count: int | None = None
    drop_last: bool | None = None
    exclude_bos: bool | None = None
    exclude_special: bool | None = None
    whole_document: bool | None = None
    exclude: tuple[str, ...] | None = None
    outlier_factor: float | None = None
    # A stream that follows a live run (reader.streaming.follow): partitions per window of
    # its first epoch. None for a stream over a fixed set of partitions.
    follow_window: int | None = None
    # How its processes share each window of the first epoch: "tokens" (each a range of
    # the window's tokens, reader.shuffle.continued_shares); None with one process, and in
    # states saved before the split (each process took whole blocks).
    follow_split: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: tuples as lists, the fields that are None left out."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StreamSettings":
        values = {}
        for f in dataclasses.fields(cls):
            value = data.get(f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)

    def differences(self, saved: "StreamSettings") -> dict[str, tuple[Any, Any]]:
        """name -> (saved, now) of each of these settings a saved state has otherwise."""
        now, before = self.to_dict(), saved.to_dict()
        return {k: (before.get(k), v) for k, v in now.items() if before.get(k) != v}


@dataclasses.dataclass(frozen=True)
class StreamState:
    """Resume after the batch of step next_step - 1, of a stream with `settings`."""

    next_step: int
    settings: StreamSettings
    version: int = STATE_VERSION
    # A following stream's record of the order partitions committed in, as it saw them
    # (reader.streaming.follow): the stream resumes, or replays, in this order, and
    # appends what committed since. None for any other stream.
    commit_order: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form saved by training jobs (version 1: the settings at top level;
        a following stream's adds commit_order)."""
        out = {"version": self.version, "next_step": self.next_step,
               **self.settings.to_dict()}
        if self.commit_order is not None:
            out["commit_order"] = list(self.commit_order)
        return out

    @classmethod
    def parse(cls, state: "StreamState | dict[str, Any]") -> "StreamState":
        """A StreamState, or its JSON form; ValueError for anything else."""
        if isinstance(state, StreamState):
            data = state.to_dict()
        elif isinstance(state, dict):
            data = state
        else:
            raise ValueError(f"resume: a StreamState or its dict form, not "
                             f"{type(state).__name__}; save it with stream.state(batch)")
        if data.get("version") != STATE_VERSION or "next_step" not in data:
            raise ValueError(f"resume: not a stream state of version {STATE_VERSION} "
                             f"(got keys {sorted(data)}); save it with stream.state(batch)")
        order = data.get("commit_order")
        return cls(int(data["next_step"]), StreamSettings.from_dict(data),
                   commit_order=None if order is None else tuple(int(p) for p in order))

    def check(self, settings: StreamSettings) -> int:
        """The step to start at; ValueError naming every setting that differs."""
        wrong = settings.differences(self.settings)
        if "follow_split" in wrong and wrong["follow_split"][0] is None:
            raise ValueError(
                "resume: this state was saved by an actx whose processes took whole blocks of "
                "a followed run's windows; this one splits each window by tokens (equal "
                "shares), so its next batch would hold other tokens and some would be read "
                "twice or never. Start the stream again without resume= (a new first epoch), "
                "or finish this one with the actx that saved the state")
        if wrong:
            raise ValueError("resume: the saved state was made with other settings, so the "
                             "order would differ: " + "; ".join(
                                 f"{k} saved {a!r}, now {b!r}" for k, (a, b) in wrong.items())
                             + ". Open the stream with the saved settings.")
        return self.next_step

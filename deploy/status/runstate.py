"""What a run directory says about its progress: `actx status`, and what rerun selects.

Reads only small objects (run.json, manifest.json, the commits/ listing, heartbeats,
activations/actx.json), never activation data, and imports neither jax nor Beam.
Partition states: committed (a marker exists: the only thing that counts as done),
in progress (a live worker holds it), stale (its worker stopped beating, failed or was
preempted) and pending (nobody holds it).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

from actx.deploy.status import host_logs
from actx.deploy.status import json_text as status_json
from actx.deploy.status import run_facts
from actx.deploy.status.partition_states import COMMITTED, IN_PROGRESS, STALE, PartitionStates
from actx.schemas import activations_info as info_lib
from actx.schemas import advice
from actx.schemas import commit as commit_lib
from actx.schemas import run_dir
from actx.schemas import config as schemas_config
from actx.schemas import heartbeat as heartbeat_lib
from actx.schemas import layout as layout_lib
from actx.schemas import manifest as manifest_lib
from actx.schemas import reference_verification as reference_lib
from actx.schemas import token_masks as token_masks_lib
from actx.schemas import verification as verification_lib

# Shared with the reader that follows a live run (schemas.run_phase).
from actx.schemas.run_phase import DEFAULT_STALE_AFTER_S, LIVE_STATES  # noqa: E402
# A worker the run refused as it started (workers.loop.admission.RunMismatch): shown while
# the run is behind, gone once it is finished.
REFUSED = "refused"


@dataclasses.dataclass(frozen=True)
class HostState:
    host: str
    state: str
    live: bool
    age_s: float
    partition: int | None
    step: int
    steps: int
    tokens_per_s: float
    tokens_done: int
    message: str
    partitions_done: int = 0
    # (unix time, tokens done) samples of this attempt, oldest first (see schemas.heartbeat).
    history: tuple[tuple[float, int], ...] = ()
    # Work shared between replicas (schemas.heartbeat): partitions this host's replica took
    # from others' lists ({"r1": 2}), its own partitions others took first, and why it has
    # nothing to extract ("" when it has, or never said).
    stolen_from: dict = dataclasses.field(default_factory=dict)
    given_up: dict = dataclasses.field(default_factory=dict)
    idle_reason: str = ""
    job: str = ""  # the launcher's job id ("" in heartbeats written before it was recorded)
    # Its process's rank in its replica (jax.distributed's process index): rank 0 commits
    # the replica's partitions; any rank stores only the rows of its own shards.
    rank: int = 0


@dataclasses.dataclass(frozen=True)
class RunStatus:
    """A snapshot of a run's progress (what `actx status --json` prints)."""

    run: str
    name: str
    fingerprint: str
    partitions: PartitionStates  # {partition id: state}
    counts: dict[str, int]
    tokens_done: int
    tokens_total: int
    bytes_done: int | None
    bytes_total: int | None
    tokens_per_s: float
    eta_s: float | None
    hosts: tuple[HostState, ...]
    stale_after_s: float
    at: float
    # Committed partitions whose data failed the latest `actx verify` (verify/latest.json).
    failed_verification: tuple[int, ...] = ()
    # Stored tokens of committed partitions that attended to their whole document up to
    # themselves (manifest full_context_tokens, from tokens/context_start).
    full_context_tokens_done: int = 0
    # Seconds from the first reporting worker's start to now (while one is live) or to the
    # last heartbeat; tokens those workers processed per second of it; and the live
    # workers' rate over their latest heartbeat interval. None: no worker has reported.
    elapsed_s: float | None = None
    average_tokens_per_s: float | None = None
    current_tokens_per_s: float = 0.0
    # What the reader's token masks leave out (stats.json, written by compute_stats); None
    # before it ran.
    token_masks: token_masks_lib.MaskCounts | None = None
    # The run's settings, the latest `actx verify` and one phase word (deploy.status.run_facts).
    identity: dict = dataclasses.field(default_factory=dict)
    verification: dict | None = None
    phase: str = ""
    # The latest `actx verify --reference` (verify/reference.json): at, ok, summary; None
    # when it never ran.
    reference: dict | None = None
    # What went wrong on the way to a complete run (a host that failed or stopped while
    # the others committed every partition), in words: history, not a failure to act on.
    # Empty while partitions are missing: then the hosts table shows the failure.
    history: tuple[str, ...] = ()
    # What prepare rejected (manifest.json): count, reasons per source, where each reject
    # is (run_facts.rejects); None when it rejected nothing.
    rejects: dict | None = None
    # What the run lost that its commits need ("" when nothing): activations/actx.json
    # gone while partitions are committed (their data was removed), with what finishes
    # it. The phase is then "failed", never "finished".
    problem: str = ""
    # Heartbeat objects that cannot be read (damaged), each error naming its object: those
    # hosts are unknown; a heartbeat is advisory, so status carries on without them.
    unreadable_heartbeats: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        # A run without partitions (its prepare accepted no document) holds nothing.
        return bool(self.partitions) and self.counts[COMMITTED] == len(self.partitions)

    @property
    def eta_word(self) -> str:
        """What stands for an ETA that has no number: "estimating" while live workers have
        no steady-state rate yet (loading, compiling, their first step), "unknown" when no
        worker is live."""
        return "estimating" if any(h.live for h in self.hosts) else "unknown"

    def ids(self, state: str) -> list[int]:
        return self.partitions.ids_in(state)

    def to_json_obj(self) -> dict:
        """What `status --json` prints, as an object."""
        return dict(self._json_fields(), partitions=self.partitions.named())

    def json_fields(self) -> dict:
        """`to_json_obj` with the partition map as `status_json.Encoded` (the fast text)."""
        return dict(self._json_fields(), partitions=status_json.Encoded(
            self.partitions.json_text))

    def _json_fields(self) -> dict:
        # Not dataclasses.asdict: it deep-copies 150k partition entries one by one.
        obj = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "partitions"}
        # A host's history is for the page (`--serve`, `--html`); here it would be 90% of it.
        obj["hosts"] = [{f.name: getattr(h, f.name) for f in dataclasses.fields(h)
                         if f.name != "history"} for h in self.hosts]
        obj["counts"] = dict(self.counts)
        obj["failed_verification"] = [layout_lib.partition_name(p)
                                      for p in self.failed_verification]
        obj["complete"] = self.complete
        obj["eta"] = self.eta_word if self.eta_s is None else round(self.eta_s, 1)
        obj["map"] = partition_map(self)
        obj["token_masks"] = (None if self.token_masks is None
                              else schemas_config.to_dict(self.token_masks))
        return obj


def _read_info_for_status(store) -> tuple[info_lib.ActivationsInfo | None, str]:
    """(activations/actx.json, "") or (None, how it is damaged; "" when absent or of a
    newer actx): status derives byte rates from it, and says what rebuilds a damaged one."""
    try:
        return info_lib.read_info(store), ""
    except info_lib.DamagedInfoError as e:
        return None, e.what
    except schemas_config.ConfigError:
        return None, ""


def bytes_per_row(handle: run_dir.OpenedRun) -> int | None:
    """Stored activation bytes per row (all hooks), from activations/actx.json."""
    info, _ = _read_info_for_status(handle.store)
    return info.bytes_per_row(handle.manifest.seq_len) if info else None


def _read_progress(handle: run_dir.OpenedRun, history: bool, now: float | None,
                   stale_after_s: float):
    """Commit ids, heartbeats (with what the silent hosts' logs say, and the time they
    are judged at), activations/actx.json and the verification record, read concurrently
    (each is one or more round trips on GCS): the silent hosts' logs are read while the
    commits/ listing, the longest of them, goes on."""
    store = handle.store
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        committed = pool.submit(commit_lib.committed_partitions, store,
                                len(handle.manifest.partitions))
        beats = pool.submit(_heartbeats_and_silence, store, history, now, stale_after_s)
        info = pool.submit(_read_info_for_status, store)
        verified = pool.submit(verification_lib.read_record_or_damage, store)
        masks = pool.submit(_read_masks_for_status, store)
        reference = pool.submit(_read_reference_for_status, store)
        return (committed.result(), *beats.result(), info.result(), verified.result(),
                masks.result(), reference.result())


def _heartbeats_and_silence(store, history: bool, now: float | None, stale_after_s: float
                            ) -> tuple[list[heartbeat_lib.Heartbeat], dict[str, str], float,
                                       tuple[str, ...]]:
    """(heartbeats, `_silent_messages` of the hosts silent at `now`, `now`, the errors of
    the heartbeat objects that cannot be read); `now` is when the heartbeats were read
    where the caller gave none."""
    damaged: list[str] = []
    beats = heartbeat_lib.read_heartbeats(store, history=history, damaged=damaged)
    now = time.time() if now is None else now
    silent = _silent_messages(store, [
        hb for hb in beats if hb.state in LIVE_STATES
        and heartbeat_lib.is_stale(hb, now, stale_after_s) and not heartbeat_lib.process_gone(hb)])
    return beats, silent, now, tuple(damaged)


def _read_reference_for_status(store) -> dict | None:
    """The latest `actx verify --reference`, as status shows it; a damaged record says so
    in its summary (`actx verify --reference` rewrites it)."""
    try:
        record = reference_lib.read_record(store)
    except (schemas_config.ConfigError, ValueError) as e:
        return {"at": None, "ok": False, "summary": f"reference: unreadable record: {e}"}
    if record is None:
        return None
    return {"at": record.at, "ok": record.ok, "summary": record.summary()}


def _read_masks_for_status(store) -> token_masks_lib.MaskCounts | None:
    """stats.json's mask counts, or None when absent or damaged (the reader says which)."""
    try:
        return token_masks_lib.read_mask_counts(store)
    except ValueError:  # schemas_config.ConfigError, or not JSON at all
        return None


def _silent_messages(store, beats: list[heartbeat_lib.Heartbeat]) -> dict[str, str]:
    """{host: message} of the hosts that stopped beating without saying why (a preempted or
    lost TPU VM dies with its worker): that it stopped (its age is the host's `age_s`; kept
    out of the message, which stays the same from one status to the next) and the last line
    of the log its host copied into the run (deploy.host_run), which is often the reason."""
    said = "stopped beating (preempted, or its host is gone)"
    lines = host_logs.last_lines(store, [(hb.job, hb.host) for hb in beats if hb.job])
    messages = {}
    for hb in beats:
        line = lines.get((hb.job, hb.host), "")
        key = layout_lib.log_key(hb.job, hb.host)
        messages[hb.host] = "; ".join(part for part in (
            hb.message, said, f"its log ({key}) ends: {line}" if line else "") if part)
    return messages


def compute_status(handle: run_dir.OpenedRun, stale_after_s: float = DEFAULT_STALE_AFTER_S,
                   now: float | None = None, history: bool = False) -> RunStatus:
    """`history`: also the hosts' (time, tokens) samples (the page draws them); without
    it, heartbeats on GCS come from one listing of their summaries."""
    (committed, beats, silent, now, damaged, (info, info_damage), verified, masks,
     reference) = _read_progress(handle, history, now, stale_after_s)
    hosts = []
    held_live: set[int] = set()
    held_dead: set[int] = set()
    # Every partition committed: what a host's last heartbeat advised (`actx rerun ...`)
    # is done, and must not be offered again.
    finished = bool(handle.manifest.partitions) and len(committed) == len(
        handle.manifest.partitions)
    for hb in sorted(beats, key=lambda b: b.host):
        if finished and hb.state == REFUSED:
            continue  # an attempt the run refused did nothing; the run is done without it
        age = max(0.0, now - hb.updated_at)
        gone = hb.state in LIVE_STATES and heartbeat_lib.process_gone(hb)
        live = (hb.state in LIVE_STATES and not heartbeat_lib.is_stale(hb, now, stale_after_s)
                and not gone)
        shown = (run_facts.shown_state(hb.state) if live or hb.state not in LIVE_STATES
                 else f"{hb.state} (process gone)" if gone else f"{hb.state} (stale)")
        message = silent.get(hb.host, hb.message)
        hosts.append(HostState(hb.host, shown, live, round(age, 1), hb.partition,
                               hb.step, hb.steps, hb.tokens_per_s if live else 0.0,
                               hb.tokens_done,
                               run_facts.without_advice(message) if finished else message,
                               hb.partitions_done, hb.history, dict(hb.stolen_from),
                               dict(hb.given_up), hb.idle_reason, hb.job,
                               hb.process_index))
        if hb.state not in ("done",):
            held = set(hb.held) | ({hb.partition} if hb.partition is not None else set())
            (held_live if live else held_dead).update(held)
    parts = handle.manifest.partitions
    column = lambda name: manifest_lib.partition_column(parts, name)  # noqa: E731
    # Later states win: committed over a live worker over a dead one.
    states = PartitionStates.build(column("id"), [
        (held_dead, STALE), (held_live, IN_PROGRESS), (committed, COMMITTED)])
    counts = states.counts()
    done = states.where(COMMITTED)
    total = lambda name: sum(map(column(name).__getitem__, done))  # noqa: E731
    tokens_done = total("tokens")
    per_row = info.bytes_per_row(handle.manifest.seq_len) if info else None
    rows_done = total("row_count")
    # Each host's rate is its steady state (workers.loop.progress: from its first tokens on),
    # 0 until it has one: start-up never counts as throughput.
    throughput = sum(h.tokens_per_s for h in hosts if h.live)
    remaining = handle.manifest.total_tokens - tokens_done
    if remaining <= 0:
        eta = 0.0
    elif throughput > 0:
        eta = remaining / throughput
    else:
        eta = None  # no live worker, or none past start-up: any number would be a guess
    elapsed, average, current = _timing(beats, hosts, now)
    problem = ""
    if committed and info_damage:
        problem = (f"{info_damage}, but {len(committed)} partition(s) are committed: "
                   f"`{advice.repair(handle.location)}` rebuilds it from run.json, the commit "
                   f"markers and the arrays' metadata (a partition whose data does not check "
                   f"out becomes pending again, for `{advice.rerun(handle.location)}`)")
    elif committed and info is None and not handle.store.exists(layout_lib.ACTIVATIONS_INFO_KEY):
        problem = (f"{layout_lib.ACTIVATIONS_INFO_KEY} is missing, but {len(committed)} "
                   f"partition(s) are committed (their activations were removed?); "
                   f"`{advice.repair(handle.location)}` turns them back into pending (where "
                   f"their arrays stand, it rebuilds it and keeps those whose data checks "
                   f"out), then "
                   f"`{advice.rerun(handle.location)}` extracts them again")
    return RunStatus(
        elapsed_s=elapsed, average_tokens_per_s=average, current_tokens_per_s=current,
        run=str(handle.location), name=handle.spec.name, fingerprint=handle.spec.fingerprint,
        partitions=states, counts=counts, tokens_done=tokens_done,
        tokens_total=handle.manifest.total_tokens,
        bytes_done=None if per_row is None else per_row * rows_done,
        bytes_total=None if per_row is None else per_row * handle.manifest.total_rows,
        full_context_tokens_done=total("full_context_tokens"),
        tokens_per_s=round(throughput, 1), eta_s=eta, hosts=tuple(hosts),
        failed_verification=tuple(p for p in verified.failed if p in committed)
        if verified else (),
        stale_after_s=stale_after_s, at=now, token_masks=masks,
        identity=run_facts.identity(handle, info, committed),
        verification=run_facts.verification(verified, set(committed)), reference=reference,
        phase=(run_facts.FAILED if problem else
               run_facts.phase(bool(parts) and counts[COMMITTED] == len(parts), hosts)),
        history=run_facts.history(hosts) if finished and not problem else (),
        rejects=run_facts.rejects(handle), problem=problem,
        unreadable_heartbeats=damaged)


def _timing(beats, hosts: list[HostState], now: float
            ) -> tuple[float | None, float | None, float]:
    """(elapsed s, average tokens/s, current tokens/s) from the heartbeats present.

    A host started at its first history sample; where a listing gave no history (GCS
    summaries), at its last beat less its tokens at its average rate.
    """
    if not beats:
        return None, None, 0.0
    starts = []
    for hb in beats:
        if hb.history:
            starts.append(hb.history[0][0])
        elif hb.tokens_per_s > 0:
            starts.append(hb.updated_at - hb.tokens_done / hb.tokens_per_s)
        else:
            starts.append(hb.updated_at)
    live = any(h.live for h in hosts)
    end = now if live else max(hb.updated_at for hb in beats)
    elapsed = max(0.0, end - min(starts))
    average = sum(hb.tokens_done for hb in beats) / elapsed if elapsed > 0 else None
    current = 0.0
    for h in hosts:
        if not h.live:
            continue
        if len(h.history) >= 2 and h.history[-1][0] > h.history[-2][0]:
            (t0, n0), (t1, n1) = h.history[-2], h.history[-1]
            current += (n1 - n0) / (t1 - t0)
        else:
            current += h.tokens_per_s
    return round(elapsed, 1), None if average is None else round(average, 1), round(current, 1)


def map_chars(status: RunStatus) -> str:
    """One character per partition, in id order: MAP_CHARS, and F for a committed
    partition that failed the latest verify."""
    return status.partitions.chars(status.failed_verification)


def partition_map(status: RunStatus, width: int = 64) -> list[str]:
    chars = map_chars(status)
    return [chars[i:i + width] for i in range(0, len(chars), width)] or [""]

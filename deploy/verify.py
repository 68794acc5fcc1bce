"""`actx verify`: re-reads committed activations and checks them against their markers.

For every committed partition and hook: the block checksums (crc32c over the stored
bytes, as the writer computed them; a float8 hook's scale array as any other), the
array's shape and dtype, blocks whose stored
object is missing (they would read as the fill value) while their marker's checksum is
not that of zeros (a block the worker wrote as zeros, which the store keeps as no object,
is read and checked as any other; so is, in a generating run, a block of padding and
unreached room alone), NaN and Inf over valid tokens
(padding positions may hold anything). Reports per-hook mean and mean L2 norm per token
(of the dequantised values in a float8 run).
Uses tensorstore, numpy and crc32c only (no jax, no Beam).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from actx.deploy import info_rebuild
from actx.schemas import absent_shards
from actx.schemas import activations_info as info_lib
from actx.schemas import advice
from actx.schemas import chunk_checksums
from actx.schemas import commit as commit_lib
from actx.schemas import config as config_lib
from actx.schemas import doc_tables
from actx.schemas import errors
from actx.schemas import layout as layout_lib
from actx.schemas import quantised
from actx.schemas import run_dir
from actx.schemas import store_errors
from actx.schemas import ts_context


@dataclasses.dataclass
class HookHealth:
    """What `verify` saw of one hook's values: non-finite counts, mean and mean norm (a
    health check; reader.stored_stats.HookStats are the normalisation statistics)."""

    partitions: int = 0
    blocks: int = 0
    tokens: int = 0
    nan: int = 0
    inf: int = 0
    value_sum: float = 0.0
    values: int = 0
    norm_sum: float = 0.0

    def to_json_obj(self, hidden: int) -> dict:
        return {"partitions": self.partitions, "blocks": self.blocks, "tokens": self.tokens,
                "hidden": hidden, "nan": self.nan, "inf": self.inf,
                "mean": self.value_sum / self.values if self.values else None,
                "mean_norm": self.norm_sum / self.tokens if self.tokens else None}


@dataclasses.dataclass
class VerifyReport:
    run: str
    checked: list[int]
    not_committed: list[int]
    hooks: dict[str, int]
    stats: dict[str, HookHealth]
    problems: list[str]
    failed: list[int] = dataclasses.field(default_factory=list)  # partitions with problems
    # Partitions whose token rows cannot be read as prepare wrote them: prepare writes them
    # again (the activations stand: a worker cannot have read a damaged chunk unnoticed).
    tokens_damaged: list[int] = dataclasses.field(default_factory=list)
    token_problems: int = 0  # of `problems`, those of the token store
    # Metadata that cannot serve the run (an array's zarr.json that is not JSON or has
    # another shape or dtype, actx.json of another spec): every committed partition
    # failed with it, and `--repair` deletes it, so the rerun's first worker writes it
    # afresh (an absent one is written anyway).
    damaged_metadata: list[str] = dataclasses.field(default_factory=list)
    # activations/actx.json rebuilt where it was damaged or missing (deploy.info_rebuild):
    # the data was checked against it, and `--repair` writes it.
    rebuilt_info: info_lib.ActivationsInfo | None = None
    rebuilt_because: str = ""  # what was wrong with it

    @property
    def only_tokens_damaged(self) -> bool:
        """Every problem is the token store's: the committed data itself checked out."""
        return bool(self.token_problems) and self.token_problems == len(self.problems)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def complete(self) -> bool:
        """Every partition asked about is committed."""
        return not self.not_committed

    def to_json_obj(self) -> dict:
        return {"run": self.run, "ok": self.ok, "complete": self.complete,
                "checked": [layout_lib.partition_name(p) for p in self.checked],
                "not_committed": [layout_lib.partition_name(p) for p in self.not_committed],
                "hooks": {h: self.stats[h].to_json_obj(d) for h, d in self.hooks.items()},
                "failed": [layout_lib.partition_name(p) for p in self.failed],
                "tokens_damaged": [layout_lib.partition_name(p) for p in self.tokens_damaged],
                "damaged_metadata": self.damaged_metadata, "problems": self.problems}


def _open(handle: run_dir.OpenedRun, key: str):
    # A named extraction's arrays are under extractions/NAME/.
    key = layout_lib.extraction_key(handle.extraction_name, key)
    return ts_context.open_array(layout_lib.array_spec(handle.location, key))


def verify_run(handle: run_dir.OpenedRun, only: set[int] | None = None) -> VerifyReport:
    spec, manifest, store = handle.spec, handle.manifest, handle.store
    committed = handle.committed()
    wanted = [p.id for p in manifest.partitions if only is None or p.id in only]
    checked = [p for p in wanted if p in committed]
    report = VerifyReport(str(handle.location), checked,
                          [p for p in wanted if p not in committed], {}, {}, [])
    problems = report.problems
    if not manifest.partitions:
        problems.append(f"the run holds no data: its prepare accepted none of its "
                        f"{manifest.docs_read} input(s) (see "
                        f"{handle.location.join(layout_lib.REJECTS_PREFIX)}); prepare it again "
                        f"with inputs that pass")
    if not checked:
        return report
    shown_key = layout_lib.extraction_key(handle.extraction_name, layout_lib.ACTIVATIONS_INFO_KEY)
    try:
        info, lost = info_lib.read_info(store), f"{shown_key}: missing"
    except info_lib.DamagedInfoError as e:
        info, lost = None, e.what
    except config_lib.ConfigError as e:  # a newer actx's record: said as it is
        problems.append(f"{e}; {len(checked)} partition(s) are committed")
        report.failed.extend(checked)  # none of them can be checked: --repair redoes them
        return report
    if info is None:
        # Rebuilt from what the run keeps besides (deploy.info_rebuild), the data is
        # checked as always; where it cannot be, nothing committed can be checked.
        info, why_not = info_rebuild.rebuild(store, spec, sorted(committed))
        if info is None:
            problems.append(f"{lost}, but {len(checked)} partition(s) are committed (their "
                            f"activations were removed?), and it cannot be rebuilt: {why_not}")
            report.failed.extend(checked)
            if store.exists(layout_lib.ACTIVATIONS_INFO_KEY):  # damaged: the rerun writes it
                report.damaged_metadata.append(layout_lib.ACTIVATIONS_INFO_KEY)
            return report
        report.rebuilt_info, report.rebuilt_because = info, lost
        unknown = info_rebuild.unknown(info)
        problems.append(f"{lost}; rebuilt for this check from run.json, the commit markers and "
                        f"the arrays' metadata (`--repair` writes it"
                        + (f"; {' and '.join(unknown)} of the first attempt: not kept by its "
                           f"markers (an earlier actx's), so unknown" if unknown else "")
                        + ")")
    if info.fingerprint != spec.fingerprint:
        problems.append(f"{layout_lib.ACTIVATIONS_INFO_KEY}: fingerprint "
                        f"{info.fingerprint} differs from run.json ({spec.fingerprint})")
        report.damaged_metadata.append(layout_lib.ACTIVATIONS_INFO_KEY)
    dtype = spec.capture.dtype
    if info.dtype != dtype:
        problems.append(f"{layout_lib.ACTIVATIONS_INFO_KEY}: dtype {info.dtype} differs "
                        f"from the run spec ({dtype})")
        if layout_lib.ACTIVATIONS_INFO_KEY not in report.damaged_metadata:
            report.damaged_metadata.append(layout_lib.ACTIVATIONS_INFO_KEY)
    report.hooks = dict(sorted(info.hooks.items()))
    report.stats = {h: HookHealth() for h in report.hooks}
    # Every stored array: the hooks, and a float8 hook's scales (schemas.quantised), which
    # the same markers checksum.
    stored = dict(sorted(info.arrays().items()))
    arrays, shards, unreadable = {}, {}, False
    for hook, (hidden, stored_dtype) in stored.items():
        want_shape = (manifest.total_rows, manifest.seq_len, hidden)
        metadata_key = f"{layout_lib.activation_array_key(hook)}/zarr.json"
        try:
            arr = _open(handle, layout_lib.activation_array_key(hook))
        except Exception as e:
            problems.append(f"array {hook}: cannot be opened: {errors.first_line(e, 400)}")
            # Gone, or not JSON: the data cannot be read (a store's passing refusal, a
            # zarr.json that parses, is reported alone: nothing to repair from here).
            data = store.read(metadata_key)
            if data is None:
                unreadable = True
            elif not _parses(data):
                unreadable = True
                report.damaged_metadata.append(metadata_key)
            continue
        if tuple(arr.shape) != want_shape:
            problems.append(f"array {hook}: shape {list(arr.shape)}, expected {list(want_shape)}")
            report.damaged_metadata.append(metadata_key)
            continue
        if arr.dtype.name != stored_dtype:
            problems.append(f"array {hook}: dtype {arr.dtype.name}, expected {stored_dtype}")
            report.damaged_metadata.append(metadata_key)
            continue
        arrays[hook] = arr
        shards[hook] = absent_shards.stored_shards(
            store, hook, -(-manifest.total_rows // spec.layout.rows_per_shard))
    tokens = _token_arrays(handle, report)
    _doc_tables(handle, report)
    rows_per_shard = spec.layout.rows_per_shard
    last, before = None, len(problems)
    for pid in checked:
        if last is not None and len(problems) > before:
            report.failed.append(last)  # the previous partition added problems
        part = manifest.partition(pid)
        where = f"partition {part.name}"
        # Read first: a token problem is the token store's, not the partition's data
        # (`--repair` leaves the partition committed; prepare writes the tokens again).
        token_rows = _check_tokens(handle, tokens, part, report)
        segment_ids = token_rows.get("segment_ids")
        last, before = pid, len(problems)
        try:
            marker = commit_lib.read_marker(store, pid)
        except ValueError as e:  # not JSON, or not a marker (config_lib.ConfigError)
            problems.append(f"{where}: its commit marker cannot be read, so its data cannot "
                            f"be checked: {_damage(e)}")
            continue
        if marker is None:  # deleted since the listing
            problems.append(f"{where}: its commit marker "
                            f"{store.location.join(layout_lib.commit_key(pid))} is gone since "
                            f"the listing")
            continue
        if marker.fingerprint != spec.fingerprint:
            problems.append(f"{where}: marker fingerprint {marker.fingerprint} differs from the "
                            f"run's ({spec.fingerprint})")
        if None not in (marker.model_digest, info.model_digest) \
                and marker.model_digest != info.model_digest:
            # Computed by other weights than the run's (a record lost, rebuilt without the
            # digest and rerun with a changed checkpoint): plausible numbers of another
            # model, whatever their checksums say.
            problems.append(f"{where}: computed by checkpoint digest {marker.model_digest}, "
                            f"but the run's activations are of {info.model_digest} "
                            f"({shown_key}): the weights at {spec.model.path} changed "
                            f"between attempts")
        if (marker.row_start, marker.row_count) != (part.row_start, part.row_count):
            problems.append(f"{where}: marker rows {marker.row_start}+{marker.row_count} differ "
                            f"from the manifest's {part.row_start}+{part.row_count}")
            continue
        problems.extend(_tokens_seen(marker, token_rows, where))
        if set(marker.checksums) != set(stored):
            problems.append(f"{where}: marker hooks {sorted(marker.checksums)} differ from "
                            f"{layout_lib.ACTIVATIONS_INFO_KEY} {sorted(stored)}")
        # Without segment ids the values' health is not counted (padding may hold anything).
        valid = None if segment_ids is None else segment_ids > 0
        unreached = (None if valid is None else
                     _unreached(arrays.get(layout_lib.GENERATED_IDS), part, valid))
        block_rows = marker.block_rows
        n_blocks = -(-part.row_count // block_rows)
        for hook, arr in arrays.items():
            sums = marker.checksums.get(hook)
            if sums is None:
                continue
            label = f"{where}, array {hook}"
            if marker.dtypes.get(hook) != stored[hook][1]:
                problems.append(f"{label}: marker dtype {marker.dtypes.get(hook)}, expected "
                                f"{stored[hook][1]}")
            if len(sums) != n_blocks:
                problems.append(f"{label}: marker has {len(sums)} block checksums, expected "
                                f"{n_blocks}")
                continue
            stats = report.stats.get(hook, HookHealth())  # a scale array's is not reported
            stats.partitions += 1
            scales = arrays.get(quantised.scale_array(hook)) if info.is_quantised(hook) else None
            for k in range(n_blocks):
                lo = part.row_start + k * block_rows
                hi = min(part.row_stop, lo + block_rows)
                missing = [s for s in absent_shards.shard_indices(lo, hi, rows_per_shard)
                           if s not in shards[hook]]
                # The store keeps a block of zeros (the fill value) as no object: the
                # marker's checksum says whether the worker wrote zeros there (a hook that
                # outputs zeros for those tokens), or whether the data is gone.
                if missing and absent_shards.is_lost(
                        hook, sums[k], hi - lo, absent_shards.row_nbytes(arr),
                        None if unreached is None else
                        unreached[lo - part.row_start:hi - part.row_start]):
                    problems.append(f"{label}: block {k} (rows {lo}-{hi - 1}) was never written "
                                    f"(stored object(s) {missing} missing, and its marker's "
                                    f"checksum is not that of zeros; it reads as fill value)")
                    continue
                try:
                    block = arr[lo:hi].read().result()
                except Exception as e:  # a corrupted object may fail to decode
                    problems.append(f"{label}: block {k} (rows {lo}-{hi - 1}) cannot be read: "
                                    f"{errors.first_line(e)}")
                    continue
                crc = commit_lib.array_checksum(block)
                if crc != sums[k]:
                    problems.append(f"{label}: checksum mismatch in block {k} "
                                    f"(rows {lo}-{hi - 1}): stored {crc}, marker {sums[k]}")
                stats.blocks += 1
                if scales is not None:  # health of the values a reader returns
                    try:
                        block = quantised.dequantise(block, scales[lo:hi].read().result())
                    except Exception:  # noqa: BLE001 - the scale array's own check says so
                        continue
                if valid is not None:
                    _accumulate(stats, block, valid[lo - part.row_start:hi - part.row_start],
                                label, k, problems)
    if last is not None and len(problems) > before:
        report.failed.append(last)
    if unreadable or report.damaged_metadata:
        # An array that cannot be read as the run needs it fails every committed partition
        # (none of their data can be read there, checked or not): `--repair` redoes them.
        report.failed = sorted(set(report.failed) | set(committed))
    return report


def _parses(data: bytes) -> bool:
    import json

    try:
        json.loads(data)
        return True
    except ValueError:
        return False


def _token_arrays(handle: run_dir.OpenedRun, report: VerifyReport) -> dict:
    """The run's token arrays, opened; one that cannot be (its zarr.json damaged or gone)
    is a problem of the token store, every checked partition's."""
    arrays = {}
    names = layout_lib.token_array_names(any(s.kind == "arc" for s in handle.spec.sources))
    for name in names:
        key = layout_lib.token_array_key(name)
        try:
            arrays[name] = ts_context.open_array(layout_lib.array_spec(handle.location, key))
        except Exception as e:  # noqa: BLE001 - said as a problem, with what to do
            report.tokens_damaged.extend(p for p in report.checked
                                         if p not in report.tokens_damaged)
            report.token_problems += 1
            report.problems.append(
                f"token array {handle.location.join(key)} cannot be opened "
                f"({errors.first_line(e)}): the token store was damaged after "
                f"prepare; `{advice.reprepare(handle.location)}` writes the same tokens again "
                f"(what is committed stays)")
    return arrays


def _doc_tables(handle: run_dir.OpenedRun, report: VerifyReport) -> None:
    """The doc tables of the checked partitions where documents start (docs/p-XXXXX.jsonl,
    prepare's: where each document is, its file and line), by one listing: one that is
    gone is a problem of the token store, which prepare writes again (the reader's
    `document` could not find its documents)."""
    stored = set(handle.store.list(layout_lib.DOCS_PREFIX))
    if not stored:  # no table at all: a run not made by prepare (a test's, a benchmark's)
        return
    gone = [p for p in report.checked if handle.manifest.partition(p).docs
            and layout_lib.docs_key(p) not in stored]
    _damaged_doc_tables(handle, report, [p for p in report.checked
                                         if layout_lib.docs_key(p) in stored])
    if not gone:
        return
    report.tokens_damaged.extend(p for p in gone if p not in report.tokens_damaged)
    report.token_problems += 1
    names = ", ".join(layout_lib.partition_name(p) for p in gone[:10])
    report.problems.append(
        f"{len(gone)} committed partition(s) lost their doc table "
        f"({handle.location.join(layout_lib.DOCS_PREFIX)}: {names}"
        f"{f' and {len(gone) - 10} more' if len(gone) > 10 else ''}): the token store was "
        f"damaged after prepare; `{advice.reprepare(handle.location)}` writes the same "
        f"tokens and tables again (what is committed stays)")


def _damaged_doc_tables(handle: run_dir.OpenedRun, report: VerifyReport,
                        partitions: list[int]) -> None:
    """The stored doc tables of `partitions`, read as the reader reads them
    (schemas.doc_tables): one that is not is a problem of the token store (the reader's
    `document` would fail on it), which prepare writes again."""
    keys = [layout_lib.docs_key(p) for p in partitions]
    damaged = []
    for pid, key, data in zip(partitions, keys, handle.store.read_many(keys)):
        if data is None:  # deleted since the listing: the next verify says so
            continue
        try:
            doc_tables.parse(data, str(handle.location.join(key)), handle.location)
        except doc_tables.DamagedDocTableError as e:
            damaged.append((pid, e))
    if not damaged:
        return
    report.tokens_damaged.extend(p for p, _ in damaged if p not in report.tokens_damaged)
    report.token_problems += 1
    more = f" (and {len(damaged) - 1} more table(s))" if len(damaged) > 1 else ""
    report.problems.append(f"{damaged[0][1]}{more}")


def _check_tokens(handle: run_dir.OpenedRun, tokens: dict, part,
                  report: VerifyReport) -> np.ndarray | None:
    """Reads every token array's rows of a partition: a stored chunk that fails its
    checksum (schemas.chunk_checksums), is missing or cannot be decoded is a problem of the
    token store, which prepare writes again. Returns the rows read, per token array (one
    not read is absent)."""
    reads = {name: arr[part.row_start:part.row_stop].read() for name, arr in tokens.items()}
    got, damaged = {}, []
    for name, read in reads.items():
        try:
            got[name] = read.result()
        except ValueError as e:
            if not chunk_checksums.is_damage(e):  # a store's refusal: said as it is
                raise store_errors.from_tensorstore(
                    e, str(handle.location.join(layout_lib.token_array_key(name))),
                    retried=True) from None
            damaged.append(f"{name} ({errors.first_line(e)})")
    if damaged:
        report.tokens_damaged.append(part.id)
        report.token_problems += 1
        report.problems.append(
            f"partition {part.name}: token rows {part.row_start}-{part.row_stop - 1} cannot be "
            f"read as prepare wrote them: {'; '.join(damaged)}. The token store was damaged "
            f"after prepare; `{advice.reprepare(handle.location)}` writes the same tokens "
            f"again (what is committed stays)")
    return {name: np.asarray(rows) for name, rows in got.items()}


def _tokens_seen(marker: commit_lib.CommitMarker, token_rows: dict, where: str) -> list[str]:
    """A partition whose stored tokens are not those its activations were computed on (the
    marker's token_checksums, of what the worker read): the token store changed after the
    extraction, e.g. prepared again from edited inputs where a chunk could not be read.
    Its data then belongs to other tokens: a failure of the partition, which `--repair`
    turns back into pending and a rerun extracts from the tokens stored."""
    problems = []
    for name, sums in sorted((marker.token_checksums or {}).items()):
        rows = token_rows.get(name)
        if rows is None:  # unreadable: said as the token store's problem
            continue
        for k, crc in enumerate(sums):
            lo = k * marker.block_rows
            stored = commit_lib.array_checksum(rows[lo:lo + marker.block_rows])
            if stored != crc:
                first = marker.row_start + lo
                last = min(marker.row_start + marker.row_count, first + marker.block_rows) - 1
                problems.append(
                    f"{where}: its activations were computed on other tokens than the token "
                    f"store holds ({name}, block {k}, rows {first}-{last}: stored {stored}, "
                    f"marker {crc}); the token store changed after the extraction (prepared "
                    f"again from other inputs?)")
                break
    return problems


def _damage(e: ValueError) -> str:
    """A damaged object's error without the generic advice: verify's own says what to do
    (`--repair` deletes the marker, `rerun` extracts the partition again)."""
    return str(e).removesuffix("; the object is damaged: rewrite it or delete it")


def _unreached(generated, part, valid: np.ndarray) -> np.ndarray | None:
    """Per row of a generating run's partition (`generated`: its generated.token_ids
    array; None in a run that does not generate): schemas.absent_shards.unreached_rows.
    The worker writes zeros there, and the store keeps a block of zeros (the arrays' fill
    value) as no object at all: such a block is read as zeros and checked against its
    checksum like any other."""
    if generated is None:
        return None
    ids = generated[part.row_start:part.row_stop].read().result()[..., 0]
    return absent_shards.unreached_rows(ids, valid)


def _accumulate(stats: HookHealth, block: np.ndarray, valid_bt: np.ndarray, label: str,
                k: int, problems: list[str]) -> None:
    vectors = block[valid_bt].astype(np.float64)  # [valid tokens, hidden]
    nan = int(np.isnan(vectors).sum())
    inf = int(np.isinf(vectors).sum())
    if nan or inf:
        problems.append(f"{label}: block {k} has {nan} NaN and {inf} Inf value(s) at valid tokens")
    finite = np.where(np.isfinite(vectors), vectors, 0.0)
    stats.nan += nan
    stats.inf += inf
    stats.tokens += vectors.shape[0]
    stats.values += vectors.size
    stats.value_sum += float(finite.sum())
    stats.norm_sum += float(np.linalg.norm(finite, axis=-1).sum())


def repair(handle: run_dir.OpenedRun, report: VerifyReport, at: float) -> list[int]:
    """Turns every partition that failed `report` back into pending: records the repair
    (with the markers, and the metadata it replaces) under verify/repairs/, then deletes
    their commit markers, so `actx rerun` extracts them again; writes a rebuilt
    activations/actx.json (`report.rebuilt_info`), recorded as a change of the run.
    Returns the partitions repaired."""
    store = handle.store
    failed = sorted(set(report.failed))
    rebuilt = report.rebuilt_info
    if not failed and rebuilt is None:
        return []
    markers = {layout_lib.partition_name(p): _marker_as_stored(store, p) for p in failed}
    replaced = report.damaged_metadata + ([layout_lib.ACTIVATIONS_INFO_KEY] if rebuilt else [])
    metadata = {key: _as_stored(store, key) for key in replaced}
    record = {"at": at, "partitions": sorted(markers), "problems": report.problems,
              "markers": markers, **({"metadata": metadata} if metadata else {})}
    # Recorded first: a repair interrupted after this loses no marker without a trace.
    store.write_json(f"{layout_lib.VERIFY_REPAIRS_PREFIX}{int(at * 1000)}.json", record)
    for p in failed:
        store.delete(layout_lib.commit_key(p))
    for key in report.damaged_metadata:  # after the markers: nothing committed reads it
        store.delete(key)
    if rebuilt is not None:
        info_lib.replace_info(store, rebuilt)
        run_dir.record_change(store, "activations-info", {
            "after": config_lib.to_dict(rebuilt), "unknown": info_rebuild.unknown(rebuilt),
            "by": "actx verify --repair", "why": report.rebuilt_because})
    return failed


def _marker_as_stored(store, partition_id: int):
    """A marker as the repair record keeps it: its JSON, or where it cannot be parsed
    (damaged) its bytes as text, so the record still holds what was deleted."""
    return _as_stored(store, layout_lib.commit_key(partition_id))


def _as_stored(store, key: str):
    """A JSON object as the repair record keeps it (see _marker_as_stored)."""
    data = store.read(key)
    if data is None:
        return None
    try:
        return store.parse_json(key, data)
    except ValueError:
        return {"unreadable": data.decode("utf-8", errors="replace")}


def leftover_temporaries(handle: run_dir.OpenedRun, remove: bool) -> list[str]:
    """The temporary files of marker writes a killed worker left under commits/ (local
    disk only; never read: a partition is committed by its marker alone); deleted when
    `remove` (`--repair`)."""
    found = handle.store.temporaries(layout_lib.COMMITS_PREFIX)
    if remove and found:
        handle.store.clear_temporaries(layout_lib.COMMITS_PREFIX)
    return found


def render(report: VerifyReport) -> str:
    lines = [f"verify {report.run}: {len(report.checked)} committed partition(s) checked"
             + (f", {len(report.not_committed)} not committed (skipped)"
                if report.not_committed else "")]
    if report.hooks:
        lines.append(f"  {'hook':<28} {'hidden':>6} {'parts':>5} {'blocks':>6} {'tokens':>10} "
                     f"{'NaN':>5} {'Inf':>5} {'mean':>11} {'mean norm':>11}")
        for hook, hidden in report.hooks.items():
            s = report.stats[hook].to_json_obj(hidden)
            mean = "-" if s["mean"] is None else f"{s['mean']:.4g}"
            norm = "-" if s["mean_norm"] is None else f"{s['mean_norm']:.4g}"
            lines.append(f"  {hook:<28} {hidden:>6} {s['partitions']:>5} {s['blocks']:>6} "
                         f"{s['tokens']:>10,} {s['nan']:>5} {s['inf']:>5} {mean:>11} {norm:>11}")
    if report.problems:
        lines.append(f"FAILED: {len(report.problems)} problem(s):")
        lines += [f"  {p}" for p in report.problems]
    else:
        lines.append("OK: every committed block matches its checksum")
    if report.not_committed:
        names = ", ".join(layout_lib.partition_name(p) for p in report.not_committed[:20])
        more = " ..." if len(report.not_committed) > 20 else ""
        lines.append(f"INCOMPLETE: {len(report.not_committed)} partition(s) not committed: "
                     f"{names}{more}; `{advice.rerun(report.run)}` extracts them "
                     f"(`--committed-only` checks only what is committed)")
    return "\n".join(lines)

"""The prepare pipeline as Beam transforms: plan units → tokenize units → plan groups →
plan rows → write partitions.

Token data never goes through a shuffle. Each file is cut into work units (`units`: a
block of lines or a range of parquet rows, at most `unit_bytes` of input); a unit is read
and tokenized in batches by one worker, which stores its tokens in the run directory
(`unit_tokens`, removed once the run is prepared) and emits only a `UnitSummary` (one
int32 per document). The global steps see small records only: one count per unit (only
when a source has max_docs: `partition.file_limits`), the unit summaries of one pack group
(`pack_group.plan_group`, grouped by key), one summary per group (`partition.build_plan`:
prefix sums) and one placement per unit (`partition.place_units`). Each partition is then
written by one worker, which reads the stored tokens of the few units in its rows.

Elements between stages: file names, `WorkUnit`s (a few hundred bytes), unit summaries
(4 bytes per document of the unit plus ~300 bytes), group summaries (~100 bytes plus the
group's ARC task ids), write tasks, per-partition stats and rejects (each under ~1 KB),
and the plan, the one element that grows with the run: ~200 bytes per unit and per pack
group, never per document (tests/test_pipeline_units.py checks a bound on the
multi-process runner).

Determinism: document order, packing and partitions are a pure function of the document
keys and token counts, never of bundle or worker order or of how files were cut into
units, so the arrays and the doc tables are byte-identical whatever the runner, its
worker count, its running mode or `unit_bytes`.
"""

from __future__ import annotations

from actx.pipeline import quiet_beam  # noqa: F401 (first: Beam's import, quietly)
import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import AsList, AsSingleton

from actx.pipeline import assemble
from actx.pipeline import deferred
from actx.pipeline import pack_group
from actx.pipeline import partition as partition_lib
from actx.pipeline import progress
from actx.pipeline import tokenize
from actx.pipeline import unit_tokens
from actx.pipeline import units as units_lib
from actx.pipeline import write_store
from actx.schemas import run_dir
from actx.schemas import runspec as runspec_lib

NAMESPACE = "actx.prepare"
REJECTS_TAG = "rejects"
LAYOUTS_TAG = "layouts"

class PlanUnitsFn(beam.DoFn):
    """(source_index, path) → the file's WorkUnits."""

    def __init__(self, spec: runspec_lib.RunSpec, unit_bytes: int):
        self.spec, self.unit_bytes = spec, unit_bytes
        self.planned = Metrics.counter(NAMESPACE, "units_planned")

    def process(self, element):
        source_index, path = element
        planned = units_lib.plan_units(self.spec, source_index, path, self.unit_bytes)
        self.planned.inc(len(planned))
        yield from planned


class TokenizeUnitFn(beam.DoFn):
    """(WorkUnit, limit) → UnitSummary (main) and Rejects ('rejects'); the unit's tokens go
    to the run directory, written in the background while the next unit is tokenized (its
    outputs leave once they are stored). The tokenizer loads once per worker."""

    def __init__(self, spec: runspec_lib.RunSpec, run_uri: str):
        self.spec, self.run_uri = spec, run_uri
        self.counters = {name: Metrics.counter(NAMESPACE, name) for name in (
            "units_tokenized", "records_read", "records_rejected", "docs_tokenized", "tokens",
            "unit_input_bytes")}
        self.unit_tokens = Metrics.distribution(NAMESPACE, "tokens_per_unit")

    def setup(self):
        self.loaded = tokenize.load_tokenizer(self.spec.tokenizer.path)
        self.store = run_dir.RunDir.at(self.run_uri).store
        # One unit is stored while the next is tokenized: two units' tokens at most.
        self.deferred = deferred.DeferredOutputs(threads=1, max_pending=1)

    def _store_unit(self, unit, tokens: unit_tokens.UnitTokens | None, docs: int,
                    n_tokens: int) -> None:
        if tokens is not None:
            self.store.write(unit_tokens.cache_key(unit.unit_id), tokens.to_bytes())
        progress.report_unit(self.store, unit, docs, n_tokens)

    def process(self, element):
        unit, limit = element
        if limit == 0:  # beyond the source's max_docs: not even an unreadable-file reject
            yield from self.deferred.add([self.deferred.submit(
                self._store_unit, unit, None, 0, 0)], [])
            return
        rejects: list = []
        tokens, summary = unit_tokens.tokenize_unit(self.loaded, self.spec, unit, limit, rejects)
        n_tokens = int(tokens.lengths.sum())
        c = self.counters
        c["units_tokenized"].inc()
        c["records_read"].inc(summary.records + len(rejects))
        c["records_rejected"].inc(len(rejects))
        c["docs_tokenized"].inc(summary.docs)
        c["tokens"].inc(n_tokens)
        c["unit_input_bytes"].inc(max(0, unit.byte_stop - unit.byte_start))
        self.unit_tokens.update(n_tokens)
        stored = self.deferred.submit(self._store_unit, unit, tokens if summary.docs else None,
                                      summary.docs, n_tokens)
        # A unit of rejects only adds nothing to the plan.
        outputs = ([summary] if summary.docs else []) + [
            beam.pvalue.TaggedOutput(REJECTS_TAG, r) for r in rejects]
        yield from self.deferred.add([stored], outputs)

    def finish_bundle(self):
        return list(self.deferred.finish())

    def teardown(self):
        self.deferred.close()


class PlanGroupFn(beam.DoFn):
    """(group key, [UnitSummary]) → GroupSummary (main) and UnitLayouts ('layouts')."""

    def __init__(self, spec: runspec_lib.RunSpec):
        self.spec = spec
        self.groups = Metrics.counter(NAMESPACE, "groups_planned")

    def process(self, element):
        key, summaries = element
        summary, layouts = pack_group.plan_group(self.spec, key, summaries)
        self.groups.inc()
        yield summary
        for layout in layouts:
            yield beam.pvalue.TaggedOutput(LAYOUTS_TAG, layout)


class WritePartitionsFn(beam.DoFn):
    """(unit id, partition ids) → one stats dict per partition written; each partition is
    one stored object per array, written here only. Its arrays (compressed by tensorstore's
    threads) and doc table are stored in the background while the next one is filled; its
    stats leave once they are stored."""

    def __init__(self, spec: runspec_lib.RunSpec, run_uri: str, separator_id: int | None,
                 committed: frozenset = frozenset(), check_only: bool = False):
        self.spec, self.run_uri, self.separator_id = spec, run_uri, separator_id
        self.committed = committed  # of a run prepared again: checked, damage alone written
        self.check_only = check_only  # the check of the committed ones, before any write
        self.partitions = Metrics.counter(NAMESPACE, "partitions_written")
        self.unit_reads = Metrics.counter(NAMESPACE, "unit_reads")

    def setup(self):
        self.run = run_dir.RunDir.at(self.run_uri)  # a string in the pickle, an object here
        self.deferred = deferred.DeferredOutputs(threads=2, max_pending=2)
        self.arrays, self.arrays_rows = {}, None  # opened once per worker and run layout

    def process(self, element, plan, checked=None):
        _, partition_ids = element
        if self.arrays_rows != plan.run.total_rows:
            self.arrays, self.arrays_rows = {}, plan.run.total_rows
        reader = assemble.UnitReader(self.run, self.spec)
        if self.check_only:
            for pid in partition_ids:
                if pid in self.committed:
                    write_store.write_partition(self.run, self.spec, plan, reader, pid,
                                                self.separator_id, self.arrays,
                                                committed=True, check_only=True)
            yield len(partition_ids)
            return
        for pid in partition_ids:
            writes: list = []
            stats = write_store.write_partition(self.run, self.spec, plan, reader, pid,
                                                self.separator_id, self.arrays, writes,
                                                self.deferred.submit, pid in self.committed)
            self.partitions.inc()
            yield from self.deferred.add(writes, [stats])
        self.unit_reads.inc(reader.reads)

    def finish_bundle(self):
        return list(self.deferred.finish())

    def teardown(self):
        self.deferred.close()


def _with_limits(units, spec: runspec_lib.RunSpec):
    """(WorkUnit, limit) per unit; limit None where the source has no max_docs.

    With max_docs, one global step over one record count per unit of a capped source cuts
    each source in (file, line) order.
    """
    if all(source.max_docs is None for source in spec.sources):
        return units | "NoLimits" >> beam.Map(lambda u: (u, None))
    limits = (units
              | "CappedUnits" >> beam.Filter(lambda u: spec.sources[u.source_index].max_docs
                                             is not None)
              | "CountRecords" >> beam.Map(lambda u: (u.key, u.records))
              | "AllUnitCounts" >> beam.combiners.ToList()
              | "UnitLimits" >> beam.Map(lambda counts: partition_lib.file_limits(spec, counts)))
    return units | "AddLimits" >> beam.Map(lambda u, lim: (u, lim.get(u.key)),
                                           lim=AsSingleton(limits))


def build(p: beam.Pipeline, spec: runspec_lib.RunSpec, run_uri: str,
          files: list[tuple[int, str]], separator_id: int | None,
          unit_bytes: int = units_lib.DEFAULT_UNIT_BYTES, committed: frozenset = frozenset(),
          committed_rows: int | None = None) -> None:
    """Adds the prepare transforms to `p`; `files` are (source_index, path), pre-expanded.
    `run_uri`: the run as a string, which Beam pickles into each step (each turns it back
    into a run_dir.RunDir where it runs). committed, committed_rows: a run prepared again
    with committed partitions, and its token arrays' rows: the inputs must make the same
    rows and, for those partitions, the same tokens (write_store)."""
    units = (p
             | "Files" >> beam.Create(files)
             | "SpreadFiles" >> beam.Reshuffle()
             | "PlanUnits" >> beam.ParDo(PlanUnitsFn(spec, unit_bytes)))
    tokenized = (_with_limits(units, spec)
                 | "SpreadUnits" >> beam.Reshuffle()
                 | "TokenizeUnits" >> beam.ParDo(TokenizeUnitFn(spec, run_uri)).with_outputs(
                     REJECTS_TAG, main="summaries"))
    groups = (tokenized.summaries
              | "KeyByGroup" >> beam.Map(lambda s: (s.unit.group, s))
              | "GroupUnitSummaries" >> beam.GroupByKey()
              | "PlanGroups" >> beam.ParDo(PlanGroupFn(spec)).with_outputs(
                  LAYOUTS_TAG, main="summaries"))
    # The global steps: one summary per pack group and one layout per unit.
    plan = (groups.summaries
            | "AllGroupSummaries" >> beam.combiners.ToList()
            | "Plan" >> beam.Map(lambda summaries: partition_lib.build_plan(spec, summaries))
            | "CreateArrays" >> beam.Map(lambda pl: write_store.create_token_arrays(
                run_dir.RunDir.at(run_uri), pl, spec, committed_rows)))
    write_plan = (groups[LAYOUTS_TAG]
                  | "AllUnitLayouts" >> beam.combiners.ToList()
                  | "PlaceUnits" >> beam.Map(lambda layouts, pl: partition_lib.place_units(
                      pl, layouts), pl=AsSingleton(plan)))
    tasks = (write_plan
             | "WriteTasks" >> beam.FlatMap(lambda wp: wp.write_tasks())
             | "SpreadWrites" >> beam.Reshuffle())
    # A run prepared again with committed partitions: every one of them checked against
    # the tokens stored (write_store), and only then anything written (a side input the
    # writes wait for), so a refusal leaves the token store as it was.
    checked = (tasks
               | "CheckCommitted" >> beam.ParDo(
                   WritePartitionsFn(spec, run_uri, separator_id, committed, check_only=True),
                   plan=AsSingleton(write_plan))
               | "AllChecked" >> beam.combiners.Count.Globally()) if committed else None
    written = (tasks
               | "WritePartitions" >> beam.ParDo(
                   WritePartitionsFn(spec, run_uri, separator_id, committed),
                   plan=AsSingleton(write_plan),
                   **({"checked": AsSingleton(checked)} if committed else {})))

    rejects_written = (tokenized[REJECTS_TAG]
                       | "KeyRejects" >> beam.Map(lambda r: (r.source, r))
                       | "GroupRejects" >> beam.GroupByKey()
                       | "WriteRejects" >> beam.MapTuple(
                           lambda name, rs: write_store.write_rejects(
                               run_dir.RunDir.at(run_uri), name, list(rs))))

    # Side inputs make the summary wait until every partition and reject file is written;
    # it goes to the run directory only (as an element it would grow with the partitions).
    _ = (p
         | "SummarySeed" >> beam.Create([None])
         | "Summary" >> beam.FlatMap(lambda _, plan, w, r: write_store.write_summary(
             run_dir.RunDir.at(run_uri), plan, w, r) and [], plan=AsSingleton(plan),
             w=AsList(written),
             r=AsList(rejects_written)))

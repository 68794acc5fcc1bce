"""The worker of a generating run (run.json's `generate`): each partition's documents are
prompts with room reserved after them (`pipeline.generation_docs`); the model writes into
that room, and the activations of every token, prompt and generated, go into the
partition's rows where the token is, with the same writer, checksums and commit as an
extraction (docs/generate.md).

Per partition: every sample document with a token in its rows is generated whole
(`workers.generate.generator.Generator`: slots refill as samples end, each token's activations from
the step that fed it), then scattered into the rows by its documents' positions. A sample
that crosses into the next partition is generated again there; generation is a function
of the run's seed, the prompt's document and the sample, so both write the same tokens.
Positions a sample did not reach (it stopped early) hold zeros and `GENERATED_UNUSED` in
`generated.token_ids`. The record of the samples that start in the partition
(`layout.generated_key`: ids, text, why each stopped, an ARC answer's grid and verdict) is
written before the commit marker.

A multi-host replica (jax.distributed, the model on a mesh spanning its processes)
generates in lockstep, as extraction's hosts run their steps: process 0 chooses the
partitions and every process takes them in its order (`distributed.broadcast_ints`, or a
`distributed.LeaderSequence` when stealing); every process reads the same prompts, runs
the same steps and reads every slot's outputs (replicated), so all make the same
decisions and hold every sample. Each writes the rows of its own slice of the partition
(`schedule.host_slice`, as an extraction host does), process 0 writes the record, and the
committer gathers every host's checksums before process 0 commits. A SIGTERM is agreed on
every `stop_check_steps` steps (`workers.replicas.stop`).

A user's Flax model is refused by name (its call takes no KV cache).
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np

from actx.schemas import arc_answer
from actx.schemas import commit as commit_lib
from actx.schemas import layout
from actx.schemas import manifest as manifest_lib
from actx.schemas import quantised
from actx.schemas import ts_context
from actx.workers.loop import admission, faults, fence, runner, schedule
from actx.workers.model import loaded as loaded_model
from actx.workers.replicas import distributed
from actx.workers.write import writer
from actx.workers.replicas.stop import Preempted

log = logging.getLogger("actx.worker")

PREFILL_LEN = 64  # prompt tokens a slot feeds per prefill step


class GenerateWorker(runner.Worker):
    """`runner.Worker` whose partitions are generated: `load_model` builds a Generator,
    `run_stream` runs partitions one after another."""

    def load_model(self) -> loaded_model.LoadedModel:
        """The checkpoint, its Generator (`self.generator`, with the sampling settings and
        the text decoder it stops by) and the run's token arrays; no extract step."""
        from actx.workers.model import capture as capture_lib
        from actx.workers.generate import generator as generate_lib
        from actx.workers.generate import config as generate_config
        from actx.workers.generate import step as generate_step
        from actx.workers.generate import text as generate_text
        from actx.workers import preflight

        spec = self.spec
        model, capture = loaded_model.load_weights(spec, self.manifest, self.mesh, self.loading)
        cfg = model.config
        self.decoder = generate_text.TextDecoder(spec.tokenizer.path)
        gen = spec.generate
        stops = gen.stop_token_ids
        if stops is None:
            templated = any(s.kind == "arc" for s in spec.sources) and \
                spec.tokenizer.chat_template is not False
            stops = self.decoder.default_stop_ids(spec.model.path, templated)
        self.stop_token_ids = tuple(stops)
        for note in preflight.generate_notes(spec):
            log.warning("%s", note)
        self.config = generate_config.GenerateConfig(
            max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_k=gen.top_k,
            top_p=gen.top_p, stop_token_ids=self.stop_token_ids,
            samples_per_prompt=gen.samples_per_prompt, seed=gen.seed,
            repetition_penalty=gen.repetition_penalty)
        max_context = spec.packing.max_context
        self.progress.say_phase("compiling the generation steps")
        self.generator = generate_lib.Generator(
            model, generate_step.load_lm_head(spec.model.path, model), capture,
            self.config, slots=self.opts.batch_size, max_length=max_context,
            prefill_len=min(PREFILL_LEN, self.manifest.seq_len))
        self._doc_tables: dict[int, list[dict]] = {}
        self._token_arrays = {
            name: ts_context.open_array(layout.array_spec(
                self.location, layout.token_array_key(name), recheck_cached_data="open"))
            for name in ("input_ids", "positions", "doc_index")}
        # No extract step (`fn`): the Generator runs the steps. The numerics record says
        # "xla-generate" or "pallas-generate" (generate_step).
        return loaded_model.LoadedModel(
            model=model, capture=capture, fn=None,
            hooks={**capture_lib.hook_widths(cfg, self.generator.hook_names),
                   layout.GENERATED_IDS: 1},
            max_context=max_context, warmup_rows=None,
            attention=f"{self.generator.attention}-generate")

    def hook_dtypes(self) -> dict[str, str]:
        return {**(super().hook_dtypes() or {}), layout.GENERATED_IDS: "int32"}

    # -- the partitions -----------------------------------------------------------------
    def run_stream(self, pool: writer.WriterPool, committer, tried: set[int],
                   sequence: list[int] | None = None) -> None:
        """Every partition left (or `sequence`, in order), one after another. The hosts of
        a replica take them in process 0's order (as `runner.Worker.run_stream`)."""
        choose = lambda: self.choose_partition(tried)  # noqa: E731
        # One-host replicas: no row over a taker's after a silence (as extraction's stream)
        self._fence = fence.Fence(self) if self.topo.hosts_per_replica == 1 else None
        if sequence is None and self.topo.hosts_per_replica > 1:
            if self.opts.steal:  # chosen (and claimed) one at a time by process 0; every
                # host waits for each in the sequence, so a SIGTERM there is the replica's
                choose = distributed.LeaderSequence(choose, wait=self.wait_for_work,
                                                    stop=self.stop_requested,
                                                    blocking=True).next
            else:
                sequence = distributed.broadcast_ints(
                    self._own_left() if self.topo.host_index == 0 else [])
        todo = iter(sequence) if sequence is not None else None
        while True:
            if todo is not None:
                pid = next(todo, -1)
                if pid >= 0 and self.topo.hosts_per_replica == 1 and self.is_committed(pid):
                    continue  # (several hosts: process 0 chose it uncommitted; all take it)
            else:
                pid = choose()  # uncommitted when chosen (the chooser read its marker)
                if pid is None:
                    self.wait_for_work()
                    continue
            if pid < 0:
                return
            self.generate_partition(self.manifest.partition(pid), pool, committer)

    def generate_partition(self, part: manifest_lib.Partition, pool: writer.WriterPool,
                           committer) -> None:
        started = time.perf_counter()
        lo, hi = part.row_start, part.row_stop
        rows = self._read_tokens(lo, hi)
        docs = self._documents(part, rows)
        self.progress.update(state="working", partition=part.id, step=0, steps=len(docs))
        prompts = [self._prompt(d, lo, hi, rows) for d in docs]
        samples = {}

        def stop_here(step: int) -> None:  # the replica's hosts agree (runner._stop_agreed)
            faults.maybe_crash("step")  # crash tests: a worker killed mid-generation
            if self._stop_agreed(step):
                raise Preempted(f"stopped while generating partition {part.id}; nothing "
                                f"of it was committed")

        for sample in self.generator.samples(
                prompts, documents=[d["doc_index"] - d["sample"] for d in docs],
                sample_indices=[d["sample"] for d in docs], before_step=stop_here):
            samples[sample.prompt_index] = sample
            self.progress.update(step=len(samples))
        blocks = self._scatter(rows, docs, samples)
        # Every host holds every sample; each writes its slice's rows, as in extraction.
        mine = schedule.host_slice(part, self.topo, self.spec.layout.rows_per_shard)
        taken = (lambda: self._fence.is_taken(part.id)) if self._fence is not None else None
        part_writer = writer.PartitionWriter(self.arrays, mine, pool, skip_if=taken)
        if self._fence is not None:
            self._fence.opened(part.id, part_writer)
        if mine[1] > mine[0]:
            part_writer.add(mine[0], {hook: values[mine[0] - lo:mine[1] - lo]
                                      for hook, values in blocks.items()},
                            {name: rows[name][mine[0] - lo:mine[1] - lo]
                             for name in commit_lib.MODEL_INPUTS if name in rows})
        if taken is not None and taken():  # the taker's record and rows stand
            return  # (the writer wrote nothing, and its commit would raise TakenOver)
        if self.topo.host_index == 0:  # the same bytes on every host: the leader's
            self.store.write(layout.generated_key(part.id), self._record(part, docs, samples))
        self.progress.add_tokens(int((rows["doc_index"][mine[0] - lo:mine[1] - lo] >= 0).sum()))
        committer.submit(part, part_writer, started)

    def _read_tokens(self, lo: int, hi: int) -> dict[str, np.ndarray]:
        reads = {name: arr[lo:hi].read() for name, arr in self._token_arrays.items()}
        return {name: np.asarray(r.result()) for name, r in reads.items()}

    def _doc_table(self, pid: int) -> list[dict]:
        if pid not in self._doc_tables:
            data = self.store.read(layout.docs_key(pid)) or b""
            if len(self._doc_tables) >= 4:  # a partition's own and the few before it
                self._doc_tables.pop(next(iter(self._doc_tables)))
            self._doc_tables[pid] = [json.loads(line) for line in data.splitlines() if line]
        return self._doc_tables[pid]

    def _documents(self, part: manifest_lib.Partition, rows: dict) -> list[dict]:
        """The doc-table rows of every document with a token in the partition's rows, in
        doc_index order: those that start in it, and one begun in an earlier partition."""
        present = set(np.unique(rows["doc_index"]).tolist()) - {-1}
        found = {d["doc_index"]: d for d in self._doc_table(part.id)
                 if d["doc_index"] in present}
        pid = part.id
        while present - set(found) and pid > 0:
            pid -= 1
            found.update((d["doc_index"], d) for d in self._doc_table(pid)
                         if d["doc_index"] in present)
        missing = present - set(found)
        if missing:
            raise RuntimeError(f"{self.location}: documents {sorted(missing)[:5]} of partition "
                               f"{part.id} are in no doc table; prepare the run again")
        for d in found.values():
            if "prompt_tokens" not in d:
                raise admission.RunMismatch(
                    f"{self.location}: document {d['doc_index']} has no prompt_tokens in its "
                    f"doc table: the token store was not prepared for generation; prepare "
                    f"it again with this spec's generate section")
        return [found[i] for i in sorted(found)]

    def _prompt(self, doc: dict, lo: int, hi: int, part_rows: dict) -> np.ndarray:
        """The prompt's ids, from the rows where its document starts: those of the
        partition's rows [lo, hi) from `part_rows`, only the others (a document begun in
        an earlier partition, a prompt running past this one) read from the token store."""
        seq_len = self.manifest.seq_len
        first = doc["first_row"]
        stop = first + -(-(doc["first_col"] + doc["prompt_tokens"]) // seq_len)
        pieces = []
        if first < lo:
            pieces.append(self._read_tokens(first, min(stop, lo)))
        if max(first, lo) < min(stop, hi):
            pieces.append({name: values[max(first, lo) - lo:min(stop, hi) - lo]
                           for name, values in part_rows.items()})
        if stop > hi:
            pieces.append(self._read_tokens(max(first, hi), stop))
        rows = {name: np.concatenate([p[name] for p in pieces]) for name in pieces[0]}
        mine = (rows["doc_index"] == doc["doc_index"]) & (rows["positions"] < doc["prompt_tokens"])
        order = np.argsort(rows["positions"][mine], kind="stable")
        ids = rows["input_ids"][mine][order]
        if len(ids) != doc["prompt_tokens"]:
            raise RuntimeError(f"{self.location}: document {doc['doc_index']}: "
                               f"{len(ids)} prompt tokens in rows {first}..{stop - 1}, its doc "
                               f"table says {doc['prompt_tokens']}")
        return ids

    def _scatter(self, rows: dict, docs: list[dict], samples: dict) -> dict[str, np.ndarray]:
        """Each hook's [rows, seq_len, width] block of the partition: every document token's
        activations at its place, zeros at padding and at unused reserved positions."""
        doc_index, positions = rows["doc_index"], rows["positions"]
        shape = doc_index.shape
        # Every stored array (a float8 hook's scales too: 1 where nothing was computed,
        # the scale of a zero row, schemas.quantised).
        blocks = {name: (np.ones if quantised.is_scale_array(name) else np.zeros)(
                      shape + tuple(array.shape[2:]), array.dtype.numpy_dtype)
                  for name, array in self.arrays.arrays.items()}
        ids = np.full(shape, layout.GENERATED_PROMPT, np.int32)
        for i, doc in enumerate(docs):
            sample = samples[i]
            r, c = np.nonzero(doc_index == doc["doc_index"])
            p = positions[r, c]
            reached = p < len(sample.token_ids)
            for hook, values in sample.activations.items():
                blocks[hook][r[reached], c[reached]] = values[p[reached]]
            generated = p >= doc["prompt_tokens"]
            ids[r, c] = np.where(
                generated, np.where(reached, sample.token_ids[np.minimum(
                    p, len(sample.token_ids) - 1)], layout.GENERATED_UNUSED),
                layout.GENERATED_PROMPT)
        blocks[layout.GENERATED_IDS] = ids[..., None]
        return blocks

    def _record(self, part: manifest_lib.Partition, docs: list[dict], samples: dict) -> bytes:
        """generated/p-NNNNN.json: the samples whose documents start in the partition."""
        entries = []
        for i, doc in enumerate(docs):
            if not part.row_start <= doc["first_row"] < part.row_stop:
                continue  # recorded by the partition it starts in
            sample = samples[i]
            text = self.decoder.text(sample.generated_ids)
            entry = {
                "doc_index": doc["doc_index"], "sample": doc["sample"],
                "prompt_doc": doc["doc_index"] - doc["sample"],
                "prompt_tokens": doc["prompt_tokens"],
                "generated_tokens": len(sample.generated_ids),
                "stop_reason": sample.stop_reason,
                "generated_ids": sample.generated_ids.tolist(), "text": text}
            if "arc_expected" in doc:  # an ARC task's answer, judged (schemas.arc_answer)
                entry["arc"] = arc_answer.judge_task(
                    text, doc["arc_expected"], doc["arc_encoder"],
                    truncated=sample.stop_reason == "length")
            entries.append(entry)
        record = {"version": layout.GENERATED_VERSION, "partition": part.id,
                  "stop_token_ids": list(self.stop_token_ids), "samples": entries}
        return json.dumps(record, sort_keys=True).encode()

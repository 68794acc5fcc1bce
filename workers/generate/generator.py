"""Batched, continuous generation with the activations of every token it feeds.

A `Generator` holds `slots` batch slots, each with its own KV cache
(`workers.generate.step`). A slot takes the next (prompt, sample) from the queue, prefills
the prompt in chunks of `prefill_len` tokens, then decodes one token per step; a slot whose
sample ends (a stop token, or max_new_tokens) takes the next one, so no step waits for the
longest answer. A step where some slot prefills has shape [slots, prefill_len] (the
decoding slots wait it out), every other step [slots, 1]: the step compiles twice.

The hooks of every token come from the step that fed it, no second forward pass. The last
generated token is fed one more step for its own activations (its logits are dropped), so a
sample's activations cover prompt and generated tokens alike: exactly what HF's forward
over prompt + generated gives for each of them. A step's hooks travel to the host while
the next step runs (only the sampled tokens are waited for).

On a mesh (the model's, from `load_pretrained(mesh=...)`) the slots split over `data` and
weights and kv heads over `model`, as extraction's step. The mesh may span the processes
of a multi-host replica (jax.distributed): every process then runs this same loop in
lockstep on the same prompts. Each builds the step's inputs from the same host-side state,
and the step's outputs (hooks, sampled tokens) come back replicated, so every process reads
every slot's values and makes the same decisions (refill, stop) without another collective.

A runner drives it with `samples` (samples as they complete) or `run` (all, in order);
`documents` gives each prompt the document id its random stream is folded from
(`workers.generate.sampling`), so a prompt generates the same text in any batch, slot or host;
its activations are the same bytes on the same slot count and mesh (elsewhere the matmuls'
shapes differ, and XLA may round them differently).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from actx.workers.model import capture as capture_lib
from actx.workers.attention import kv_cache
from actx.workers.generate import step as generate_step, sampling
from actx.workers.model import sharding
from actx.workers.model import decoder as model_lib
from actx.workers.model import quantise
from actx.workers.model.checkpoint import TOP_PARAM_AXES
from actx.workers.generate.config import GenerateConfig, GenerateError

STOP_TOKEN = "stop_token"
LENGTH = "length"


@dataclasses.dataclass(frozen=True)
class Sample:
    """One generated sample of one prompt.

    activations: {hook: [len(prompt_ids) + len(generated_ids), width]}, prompt tokens
    first, then every generated token, the last one included.
    stop_reason: STOP_TOKEN (the last generated id is a stop token) or LENGTH.
    """

    prompt_index: int
    sample_index: int
    prompt_ids: np.ndarray
    generated_ids: np.ndarray
    stop_reason: str
    activations: dict[str, np.ndarray]

    @property
    def token_ids(self) -> np.ndarray:
        """int32 [prompt + generated]: the tokens the activations are of."""
        return np.concatenate([self.prompt_ids, self.generated_ids])

    @property
    def generated_mask(self) -> np.ndarray:
        """bool [prompt + generated]: True for generated tokens, False for the prompt's.
        A token's position in its text is its index."""
        return np.arange(len(self.prompt_ids) + len(self.generated_ids)) >= len(
            self.prompt_ids)


@dataclasses.dataclass
class _Slot:
    prompt_index: int
    document: int
    sample: int
    prompt: np.ndarray
    fed: int = 0
    generated: list = dataclasses.field(default_factory=list)
    # Per hook [max_length, width], filled as tokens are fed: a step's host arrays are
    # not kept alive by views until the sample ends.
    acts: dict = dataclasses.field(default_factory=dict)
    stop_reason: str | None = None

    def store(self, name: str, acts_tw: np.ndarray, at: int, max_length: int) -> None:
        if name not in self.acts:
            self.acts[name] = np.empty((max_length,) + acts_tw.shape[1:], acts_tw.dtype)
        self.acts[name][at:at + len(acts_tw)] = acts_tw

    def finish(self) -> Sample:
        return Sample(self.prompt_index, self.sample, self.prompt,
                      np.asarray(self.generated, np.int32), self.stop_reason,
                      {name: acts[:self.fed].copy() for name, acts in self.acts.items()})


class Generator:
    """Generates samples of prompts on `slots` batch slots, capturing `spec`'s hooks.

    max_length: tokens per slot the cache holds: a prompt's tokens + max_new_tokens
      (at most the model's max_position_embeddings).
    prefill_len: prompt tokens a slot feeds per prefill step (longer prompts take several).
    attention: "xla" or "pallas" (`generate_step.attention_for`: by default the Pallas
      kernel on TPUs and half precision on GPUs, where it compiles).
    trace_count: times a step was traced (2: one per step shape; 1 with prefill_len 1).
    steps: steps run so far.
    """

    def __init__(self, model: model_lib.Model, head: generate_step.LMHead,
                 spec: capture_lib.CaptureSpec, config: GenerateConfig, *, slots: int,
                 max_length: int, prefill_len: int = 64, attention: str | None = None):
        cfg = model.config
        spec.validate(cfg)
        config.validate(cfg.vocab_size, cfg.max_position_embeddings)
        if config.max_new_tokens >= max_length:
            raise GenerateError(
                f"generate.max_new_tokens={config.max_new_tokens}: a cache of max_length="
                f"{max_length} tokens per slot leaves no room for a prompt; lower it or "
                f"raise max_length")
        if cfg.max_position_embeddings and max_length > cfg.max_position_embeddings:
            raise GenerateError(f"max_length={max_length} is beyond the model's "
                                f"max_position_embeddings={cfg.max_position_embeddings}")
        if slots < 1 or prefill_len < 1:
            raise ValueError(f"slots={slots} and prefill_len={prefill_len} must be >= 1")
        if cfg.rope.has_long_factors:
            raise GenerateError(
                f"{cfg.architecture}: longrope switches to its long factors once a text "
                f"outgrows original_max_position_embeddings="
                f"{cfg.rope.original_max_position_embeddings}, which a text still being "
                f"generated cannot know; use a checkpoint whose long and short factors "
                f"are equal")
        self.mesh = model.mesh
        # Hosts in lockstep (a mesh spanning processes): inputs are made global arrays and
        # outputs come back replicated (`_place`).
        self.multi_process = self.mesh is not None and jax.process_count() > 1
        if self.mesh is not None:
            sharding.check_batch(slots, self.mesh)
        self.config, self.spec, self.model_config = config, spec, cfg
        self.slots, self.max_length, self.prefill_len = slots, max_length, prefill_len
        self.hook_names = spec.hook_names(cfg.num_layers, capture_lib.router_layers_of(cfg))
        self.trace_count = 0
        self.steps = 0
        self.attention = generate_step.attention_for(model.dtype, cfg, max_length, attention)
        self._params = model.params
        point_layers = spec.point_layers(cfg.num_layers, capture_lib.router_layers_of(cfg))
        global_points = spec.global_points()
        out_dtype = quantise.compute_dtype(spec.dtype)
        # What each step returns: the hooks, and a float8 capture's scales (quantised on
        # the device, as extraction's step does: workers.model.quantise).
        self.output_names = quantise.output_names(self.hook_names, spec.dtype)

        penalty = config.repetition_penalty
        self.penalised = penalty != 1.0

        def run_step(params, head_vd, cache, tokens_bt, start_b, count_b, document_b,
                     sample_b, index_b):
            self.trace_count += 1  # Python side effect: runs only when tracing
            last_b = jnp.maximum(count_b - 1, 0)
            hooks, logits_bv, cache = generate_step.step(
                params, generate_step.LMHead(head_vd, head.final_softcap), cfg, cache,
                tokens_bt, start_b, last_b, point_layers=point_layers,
                global_points=global_points, out_dtype=out_dtype, attention=self.attention)
            hooks = quantise.quantise_outputs(hooks, spec.dtype)
            if self.penalised:
                seen_bv = _seen(cache.seen_bv, tokens_bt, start_b, count_b)
                cache = dataclasses.replace(cache, seen_bv=seen_bv)
                logits_bv = sampling.penalise(logits_bv, seen_bv, penalty)
            next_b = sampling.choose(
                logits_bv, temperature=config.temperature, top_k=config.top_k,
                top_p=config.top_p, seed=config.seed, document_b=document_b,
                sample_b=sample_b, index_b=index_b)
            return hooks, next_b, cache

        self._place(model, run_step, head.weight_vd)

    def _place(self, model: model_lib.Model, run_step, head_vd) -> None:
        """Jits the step and makes the empty cache: on one device, or on the mesh with
        slots over `data` and weights, kv heads and experts over `model` (as extraction's
        step)."""
        cfg, slots, max_length, mesh = model.config, self.slots, self.max_length, self.mesh

        def make_cache():
            return generate_step.zeros(cfg, slots, max_length, model.dtype, self.penalised)

        if mesh is None:
            self._step = jax.jit(run_step, donate_argnums=(2,))
            self._cache = jax.jit(make_cache)()
            self._head_vd = head_vd
            return

        def named(axes, shape):
            return sharding.logical_sharding(axes, shape, mesh)

        def is_axes(x):
            return isinstance(x, tuple)

        params = jax.tree.map(lambda axes, p: named(axes, p.shape), model.param_axes,
                              model.params, is_leaf=is_axes)
        head = named(TOP_PARAM_AXES["embed_vd"], head_vd.shape)
        caches = jax.tree.map(lambda axes, leaf: named(axes, leaf.shape),
                              generate_step.SlotCache(kv_cache.KV_AXES, kv_cache.KV_AXES,
                                                      generate_step.SEEN_AXES),
                              jax.eval_shape(make_cache), is_leaf=is_axes)
        rows, per_slot = (sharding.data_parallel_sharding(mesh, n) for n in (2, 1))
        self._input_shardings = (rows,) + (per_slot,) * 5
        if self.multi_process:
            # Every process reads every slot's hooks and sampled token: the same decisions
            # on every host, and each host writes its own rows of any slot's sample.
            everywhere = sharding.replicated(mesh)
            hooks = {name: everywhere for name in self.output_names}
            next_out = everywhere
        else:
            hooks = {name: sharding.data_parallel_sharding(mesh, 3)
                     for name in self.output_names}
            next_out = per_slot
        self._step = jax.jit(run_step, donate_argnums=(2,),
                             in_shardings=(params, head, caches) + self._input_shardings,
                             out_shardings=(hooks, next_out, caches))
        self._cache = jax.jit(make_cache, out_shardings=caches)()
        if self.multi_process and getattr(head_vd, "is_fully_addressable", True):
            # A host-side (or one-device) head: every process holds the same values.
            self._head_vd = _global(np.asarray(head_vd), head)
        else:
            self._head_vd = jax.device_put(head_vd, head)

    def _global_inputs(self, inputs: tuple) -> tuple:
        """The step's host inputs as it takes them: as they are on one process, global
        arrays (each process its shards of the same values) on a mesh spanning several."""
        if not self.multi_process:
            return inputs
        return tuple(_global(x, s) for x, s in zip(inputs, self._input_shardings))

    def check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """The prompts as int32 arrays; refuses (before any work) an empty one, ids
        outside the vocabulary, or one that leaves no room for max_new_tokens."""
        out = []
        vocab = self.model_config.vocab_size
        room = self.max_length - self.config.max_new_tokens
        for i, prompt in enumerate(prompts):
            ids = np.asarray(prompt, np.int64).reshape(-1)
            if ids.size == 0:
                raise GenerateError(f"prompt {i} is empty: generation needs at least one "
                                    f"token to start from")
            if ids.min() < 0 or ids.max() >= vocab:
                raise GenerateError(f"prompt {i}: token ids outside the model's vocabulary "
                                    f"of {vocab}")
            if ids.size > room:
                raise GenerateError(
                    f"prompt {i}: {ids.size} tokens + generate.max_new_tokens="
                    f"{self.config.max_new_tokens} exceed max_length={self.max_length} "
                    f"tokens per slot; lower max_new_tokens or raise max_length")
            out.append(ids.astype(np.int32))
        return out

    def run(self, prompts: Sequence[Sequence[int]],
            documents: Sequence[int] | None = None) -> list[Sample]:
        """Every sample of every prompt, ordered by (prompt_index, sample_index)."""
        done = list(self.samples(prompts, documents))
        return sorted(done, key=lambda s: (s.prompt_index, s.sample_index))

    def samples(self, prompts: Sequence[Sequence[int]],
                documents: Sequence[int] | None = None,
                sample_indices: Sequence[int] | None = None,
                before_step: Callable[[int], None] | None = None) -> Iterator[Sample]:
        """Generates every (prompt, sample) and yields each sample as it completes.

        documents: per prompt, the id its random streams are folded from (default: its
        index); give the run's global document ids so a prompt samples the same text in
        any partition.
        sample_indices: when given, each prompt is one sample, of this index (a run's
        token store holds each sample as a document of its own); else every prompt has
        config.samples_per_prompt samples, 0...
        before_step(i): called before the call's i-th step is dispatched (0, 1, ...; the
        same on every process of a replica), e.g. to stop there by raising.
        """
        prompts = self.check_prompts(prompts)
        documents = list(range(len(prompts))) if documents is None else list(documents)
        if len(documents) != len(prompts):
            raise ValueError(f"{len(documents)} documents for {len(prompts)} prompts")
        if documents and not 0 <= min(documents) <= max(documents) < 2**31:
            raise ValueError("document ids must be in [0, 2**31): they seed int32 streams")
        if sample_indices is None:
            work = [(i, s) for i in range(len(prompts))
                    for s in range(self.config.samples_per_prompt)]
        else:
            if len(sample_indices) != len(prompts):
                raise ValueError(f"{len(sample_indices)} sample indices for {len(prompts)} "
                                 f"prompts")
            work = list(enumerate(int(s) for s in sample_indices))
        queue = collections.deque(_Slot(i, documents[i], s, prompts[i]) for i, s in work)
        active: list[_Slot | None] = [None] * self.slots
        stop_ids = set(self.config.stop_token_ids)
        pending = None  # the previous step's hooks, still on their way to the host
        index = 0
        while True:
            for i in range(self.slots):
                if active[i] is None and queue:
                    active[i] = queue.popleft()
            step = None
            if any(s is not None for s in active):
                if before_step is not None:
                    before_step(index)
                index += 1
                inputs, counts = self._inputs(active)
                hooks, next_b, self._cache = self._step(self._params, self._head_vd,
                                                        self._cache,
                                                        *self._global_inputs(inputs))
                self.steps += 1
                for array in hooks.values():
                    array.copy_to_host_async()
                step = (hooks, [(i, active[i], active[i].fed, n)
                                for i, n in enumerate(counts) if n], [])
            if pending is not None:  # while this step runs on the device
                yield from self._store(*pending)
            if step is None:
                return
            next_b = np.asarray(next_b)
            for i, slot, _, n in step[1]:
                slot.fed += n
                if slot.stop_reason is not None:  # that fed its last token: done
                    step[2].append(slot)
                    active[i] = None
                elif slot.fed == len(slot.prompt) + len(slot.generated):
                    token = int(next_b[i])
                    slot.generated.append(token)
                    if token in stop_ids:
                        slot.stop_reason = STOP_TOKEN
                    elif len(slot.generated) == self.config.max_new_tokens:
                        slot.stop_reason = LENGTH
            pending = step

    def _store(self, hooks, fed, done) -> Iterator[Sample]:
        """Stores a step's hooks of each slot's tokens, then yields the samples that
        step completed. fed: (slot index, slot, its first position, tokens fed)."""
        hooks = jax.device_get(hooks)
        for i, slot, at, n in fed:
            for name in self.output_names:
                slot.store(name, hooks[name][i, :n], at, self.max_length)
        for slot in done:
            yield slot.finish()

    def _inputs(self, active: list[_Slot | None]):
        """The step's arrays (tokens, start, count, document, sample, token index) and each
        slot's count of real tokens: a prompt chunk where any slot prefills (the others
        idle), else each slot's last generated token."""
        prefill = any(s is not None and s.fed < len(s.prompt) for s in active)
        t = self.prefill_len if prefill else 1
        b = self.slots
        tokens = np.zeros((b, t), np.int32)
        start, count, document, sample, index = (np.zeros((b,), np.int32) for _ in range(5))
        counts = [0] * b
        for i, slot in enumerate(active):
            if slot is None:
                continue
            start[i], document[i], sample[i] = slot.fed, slot.document, slot.sample
            index[i] = len(slot.generated)
            if prefill:
                chunk = slot.prompt[slot.fed:slot.fed + t]
            else:
                chunk = np.asarray(slot.generated[-1:], np.int32)
            tokens[i, :len(chunk)] = chunk
            counts[i] = count[i] = len(chunk)
        return (tokens, start, count, document, sample, index), counts


def _seen(seen_bv: jax.Array, tokens_bt: jax.Array, start_b: jax.Array,
          count_b: jax.Array) -> jax.Array:
    """The record of fed ids after this step: a slot that starts a sample (its first
    tokens, at position 0) forgets its last sample's, then each slot adds the real tokens
    it fed (the first count_b of its row)."""
    starts_b = (start_b == 0) & (count_b > 0)
    seen_bv = jnp.where(starts_b[:, None], False, seen_bv)
    real_bt = jnp.arange(tokens_bt.shape[1], dtype=jnp.int32) < count_b[:, None]
    # A padding token goes to index vocab, beyond the record: dropped.
    ids_bt = jnp.where(real_bt, tokens_bt, seen_bv.shape[1])
    rows_b1 = jnp.arange(seen_bv.shape[0])[:, None]
    return seen_bv.at[rows_b1, ids_bt].set(True, mode="drop")


def _global(values: np.ndarray, where) -> jax.Array:
    """`values` (the same on every process) as a global array of sharding `where`."""
    return jax.make_array_from_callback(values.shape, where, lambda index: values[index])

"""Admission: whether this worker may write into a run, checked before any step runs.

A worker refuses a run whose fingerprint, vocabulary, token layout, model weights or
numerics differ from what it would write, and a max_context whose cache would not fit its
chips (beside the weights, attention's and a mixture of experts' working memory): each
refusal says what differs and what to do. `step_cost` counts a step's weight bytes and
FLOPs, a mixture of experts' from its active experts only.
"""

from __future__ import annotations

import dataclasses

from actx.schemas import activations_info as info_lib
from actx.schemas import advice
from actx.schemas import config as config_lib
from actx.schemas import errors
from actx.schemas import layout
from actx.schemas import parallelism
from actx.schemas import position_limits
from actx.schemas import quantised
from actx.schemas import run_dir
from actx.schemas import tokenizer_identity
from actx.workers.attention import kv_cache
from actx.workers.model import sharding
from actx.workers.write import metadata


class RunMismatch(errors.UserError, ValueError):
    """The run directory does not belong to this worker's spec, model or numerics."""


def check_spec(location, spec, manifest, expect_fingerprint: str | None,
               run_spec=None) -> None:
    """`spec` (the extraction's) is the one the worker expects, and the manifest is the
    run's (`run_spec`, the root run.json, when `spec` is a named extraction's)."""
    if run_spec is not None and run_spec.fingerprint != spec.fingerprint:
        check_spec(location, run_spec, manifest, None)
        return _check_expected(location, spec, expect_fingerprint)
    _check_expected(location, spec, expect_fingerprint)
    if manifest.fingerprint != spec.fingerprint:
        raise RunMismatch(
            f"{location}: manifest.json was prepared for fingerprint {manifest.fingerprint} "
            f"but run.json says {spec.fingerprint}; re-run `actx prepare` into a fresh "
            f"directory")


def _check_expected(location, spec, expect_fingerprint: str | None) -> None:
    if expect_fingerprint and expect_fingerprint != spec.fingerprint:
        raise RunMismatch(
            f"{location}: run fingerprint {spec.fingerprint} differs from this worker's spec "
            f"({expect_fingerprint}); the run was prepared with another configuration. Use a "
            f"new run directory, or the spec the run was made with")


def check_vocabulary(spec, manifest, cfg) -> None:
    """The run's tokenizer is this model's (schemas.tokenizer_identity): its vocabulary
    fits the embedding, the bos/eos/pad ids of the model's configs are its special tokens,
    and a tokenizer.json in the checkpoint is the one the run was prepared with. The model
    may have changed since the prepare's own check (another checkpoint at the path, a
    switched spec.model)."""
    allowed = spec.tokenizer.allow_model_mismatch
    recorded = spec.tokenizer_identity
    # Runs of spec_version 2 record no identity, and older manifests no special ids.
    specials_known = recorded is not None or bool(manifest.special_token_ids)
    named = ([] if allowed or not specials_known
             else tokenizer_identity.special_ids_named(spec.model.path))
    problems = tokenizer_identity.vocabulary_problems(
        spec.tokenizer.path, manifest.vocab_size, manifest.special_token_ids,
        spec.model.path, cfg.vocab_size, named, allowed=allowed)
    if recorded is not None and not allowed:
        problems += tokenizer_identity.recorded_problems(recorded, spec.tokenizer.path,
                                                         spec.model.path)
    if problems:
        raise RunMismatch(problems[0] if len(problems) == 1 else
                          f"{len(problems)} problems:\n  " + "\n  ".join(problems))


def check_token_layout(store, location) -> None:
    """The token store's arrays open: a token array's metadata lost or damaged (a store
    damaged after prepare) is named with the prepare that writes it again, where rerunning
    would fail the same way; one without `context_start` alone is an older prepare's."""
    for name in layout.TOKEN_ARRAYS:
        meta = f"{layout.token_array_key(name)}/zarr.json"
        try:
            value = store.read_json(meta)
            damage = ("missing" if value is None else "" if isinstance(value, dict)
                      else "damaged (not an array's metadata)")
        except ValueError:
            damage = "damaged (not JSON)"
        # (context_start alone missing, the others there: an older prepare's, below)
        if damage and not (name == "context_start" and damage == "missing"):
            raise RunMismatch(
                f"{location.join(meta)}: {damage}; the token store was damaged after "
                f"prepare: `{advice.reprepare(location)}` writes the same tokens again "
                f"(what is committed stays), then `{advice.rerun(location)}` extracts what "
                f"is left")
    key = layout.token_array_key("context_start")
    if not store.exists(f"{key}/zarr.json"):
        raise RunMismatch(
            f"{location.join(key)}: missing; the token store was written by an older prepare "
            f"that does not record what each token attended to. Prepare the data again into "
            f"a new run directory")


def check_activation_metadata(store, location, hooks) -> None:
    """Each hook's array metadata reads (`activations/<hook>/zarr.json`): a damaged one
    (not JSON, not an object) is named with the repair that mends it, where the array's
    open would fail in tensorstore's words and a rerun the same way. A missing one is
    written (create-only) as for a new hook."""
    for hook in hooks:
        meta = f"{layout.activation_array_key(hook)}/zarr.json"
        try:
            value = store.read_json(meta)
            damaged = value is not None and not isinstance(value, dict)
        except ValueError:
            damaged = True
        if damaged:
            shown = location.join(layout.extraction_key(getattr(store, "name", ""), meta))
            raise RunMismatch(
                f"{shown}: damaged (not an array's metadata); `{advice.repair(location)}` "
                f"mends it (the partitions whose data it cannot vouch for turn pending), "
                f"then `{advice.rerun(location)}` extracts what is left")


def check_context_fits(jax, spec, model, fn, mesh, batch_size: int, model_parallel: int,
                       seq_len: int, max_context: int | None) -> None:
    """max_context within the model's declared context, and its cache on the chips; every
    position within a model's learned position embeddings (GPT-2)."""
    cfg = model.config
    if cfg.learned_positions and spec is not None:
        learned = position_limits.learned_position_problems(
            spec.packing, cfg.max_position_embeddings, cfg.architecture, spec.model.path,
            spec.generate is not None)
        if learned:
            raise ValueError(f"{learned[0]}, and prepare the run again")
    if max_context is None:
        return
    if cfg.rope.has_long_factors:
        raise ValueError(
            f"packing.max_context={max_context}: {cfg.architecture}'s longrope takes its "
            f"long factors for a whole document longer than original_max_position_embeddings="
            f"{cfg.rope.original_max_position_embeddings}, which rows of a long document "
            f"seen through the KV cache cannot know; prepare the run without max_context "
            f"(documents as rows)")
    problem = position_limits.context_problem(spec.packing, cfg.max_position_embeddings,
                                              spec.model.path)
    if problem:
        raise ValueError(f"{problem}, and prepare the run again")
    device = jax.local_devices()[0]
    stats = device_memory_stats(jax)
    weights = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(model.params))
    slots = batch_size // sharding.axis_size(mesh, "batch")
    heads = parallelism.heads_per_device(cfg.num_heads, model_parallel)
    kv_cache.check_fits(
        fn.cache_bytes_per_device(batch_size, seq_len), weights,
        kv_cache.attention_scratch_bytes(
            slots, heads, seq_len, kv_cache.capacity_tokens(max_context, seq_len),
            fn.attention_implementation(seq_len),
            2 * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize)
        + moe_scratch_bytes(cfg, slots, seq_len, model.dtype.itemsize),
        stats.get("bytes_limit"),
        max_context=max_context, slots_per_device=slots, layers_run=fn.layers_run,
        device_kind=device.device_kind)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What one step over `tokens` tokens costs, from the blocks that run.

    weight_bytes: the weights the step reads (a mixture of experts: its router and only
      the experts some token chose, at most min(experts, tokens * k) per layer).
    flops: the matmuls' FLOPs (2 per multiply-add): projections, the MLP or the router and
      k experts per token, and attention's scores and mixing over `keys_per_query` keys.
    """

    weight_bytes: int
    flops: int


def step_cost(cfg, tokens: int, layers: int | None = None, itemsize: int = 2,
              keys_per_query: int = 0) -> StepCost:
    """The weights read and FLOPs of a step over `tokens` tokens through `layers` blocks
    (default: all), with weights of `itemsize` bytes; no LM head (actx computes none)."""
    layers = cfg.num_layers if layers is None else layers
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attention_params = d * (n + 2 * k) * h + n * h * d
    attention_flops = 2 * attention_params + 4 * n * h * keys_per_query
    weight_bytes, flops = tokens * d * itemsize, 0  # the embedding rows the step gathers
    # Each layer's own MLP: a mixture's sparse layers, the dense ones between them.
    for moe_layer in getattr(cfg, "moe_per_layer", (bool(cfg.num_experts),) * layers)[:layers]:
        if moe_layer:
            expert_params = 3 * d * cfg.moe_intermediate_size
            shared = getattr(cfg, "shared_expert_size", 0)
            shared_params = 3 * d * shared + d if shared else 0  # and its gate
            active = min(cfg.num_experts, tokens * cfg.experts_per_token)
            # router + active experts (+ a shared expert every token runs)
            mlp_params = d * cfg.num_experts + active * expert_params + shared_params
            mlp_flops = (2 * d * cfg.num_experts + cfg.experts_per_token * 2 * expert_params
                         + 2 * shared_params)
        else:
            mlp_params = 3 * d * cfg.intermediate_size
            mlp_flops = 2 * mlp_params
        weight_bytes += (attention_params + mlp_params + 4 * d) * itemsize  # + norms
        flops += (attention_flops + mlp_flops) * tokens
    return StepCost(weight_bytes=weight_bytes, flops=flops)


def moe_scratch_bytes(cfg, rows_per_device: int, seq_len: int, itemsize: int) -> int:
    """A mixture of experts' working set in one layer on one device: the router's float32
    probabilities, and the grouped matmuls' gate, up and activation [tokens * k, width]
    and outputs [tokens * k, hidden] (workers.model.moe); 0 for a dense model."""
    if not cfg.num_experts:
        return 0
    tokens = rows_per_device * seq_len
    routed = tokens * cfg.experts_per_token
    return (tokens * cfg.num_experts * 4
            + routed * (3 * cfg.moe_intermediate_size + 2 * cfg.hidden_size) * itemsize)


def device_memory_stats(jax) -> dict:
    """The first local device's memory statistics (`bytes_limit`, `bytes_in_use`, ...);
    {} where the backend keeps none (the CPU)."""
    try:
        return jax.local_devices()[0].memory_stats() or {}
    except Exception:  # backends without memory statistics
        return {}


def numerics_key(jax, mesh, batch_size: int, model_parallel: int,
                 attention: str | None = None) -> info_lib.Numerics:
    """What, besides the RunSpec, decides the bytes a step produces."""
    device = jax.devices()[0]
    return info_lib.Numerics(platform=device.platform, device_kind=device.device_kind,
                             jax=jax.__version__,
                             rows_per_device=batch_size // sharding.axis_size(mesh, "batch"),
                             model_parallel=model_parallel, attention=attention)


def check_activation_info(store, location, spec, hooks: dict, model_digest: str,
                          numerics: info_lib.Numerics, allow_numerics_change: bool,
                          nothing_committed: bool = False,
                          hook_dtypes: dict[str, str] | None = None,
                          architecture: str | None = None,
                          transformer_lens_differs: str | None = None, writes: bool = True,
                          wait_s: float = metadata.WAIT_S,
                          writer_gone=lambda: None) -> None:
    """Records what this run's activations are (create-only), or checks this worker
    against the record of the first attempt. hook_dtypes: the hooks stored in another
    dtype than the capture's (`capture.hook_dtypes`: a mixture of experts' int32 ids);
    architecture: the model's HF architecture (for the reader's TransformerLens names);
    transformer_lens_differs: where TransformerLens's model of this checkpoint differs
    (schemas.hook_aliases.model_difference).

    While nothing is committed, a worker whose numerics or checkpoint digest differ from an
    earlier attempt's (a new batch size, another device kind, re-downloaded weights) takes
    the record over, and the change is recorded: no stored activation depends on it yet.

    writes: whether this process writes the record (`metadata.writes_metadata`); the
    others never write it: they wait up to `wait_s` for it (or, where the writer takes an
    earlier attempt's record over, for the new one), or until `writer_gone()` says why the
    writer will not write it, then check against it.
    """
    mine = info_lib.ActivationsInfo(fingerprint=spec.fingerprint, dtype=spec.capture.dtype,
                                    hooks=dict(hooks), model_digest=model_digest,
                                    numerics=numerics, hook_dtypes=hook_dtypes,
                                    architecture=architecture,
                                    transformer_lens_differs=transformer_lens_differs,
                                    quantisation_version=quantised.FORMAT_VERSION
                                    if quantised.is_quantised(spec.capture.dtype) else None)
    key = location.join(layout.extraction_key(getattr(store, "name", ""),
                                              layout.ACTIVATIONS_INFO_KEY))
    replaceable = lambda first: (  # noqa: E731
        nothing_committed and first != mine and (first.fingerprint, first.dtype, first.hooks)
        == (mine.fingerprint, mine.dtype, mine.hooks))
    if not writes:
        first = metadata.wait_for(lambda: info_lib.read_info(store), str(key),
                                  str(location), wait_s, writer_gone)
        if replaceable(first):  # the writer takes it over, with what this worker has
            def taken_over():
                info = info_lib.read_info(store)
                return info if info == mine else None

            first = metadata.wait_for(
                taken_over, f"{key} (with this worker's numerics and checkpoint)",
                str(location), wait_s, writer_gone)
    elif not nothing_committed and info_lib.read_info(store) is None:
        # Deleted with partitions committed: a record made afresh would vouch for what
        # they were computed with, unseen (other weights would pass). verify rebuilds it
        # from what the run keeps, the markers' checkpoint digest included.
        raise RunMismatch(
            f"{key}: missing, but partitions are committed (their activations were "
            f"removed?); `{advice.repair(location)}` turns them back into pending (where "
            f"their arrays stand, it rebuilds it and keeps those whose data checks out), "
            f"then `{advice.rerun(location)}` extracts them again")
    elif info_lib.create_info(store, mine):
        return
    else:
        first = info_lib.read_info(store)
    if first is None:  # deleted between the create attempt and this read
        raise RunMismatch(f"{key}: vanished while this worker checked it; run again")
    if first == mine:
        return
    if writes and replaceable(first):
        info_lib.replace_info(store, mine)
        run_dir.record_change(store, "activations-info", {
            "before": config_lib.to_dict(first), "after": config_lib.to_dict(mine),
            "why": "numerics or checkpoint differ from an earlier attempt that committed "
                   "nothing"})
        return
    if first.model_digest not in (None, mine.model_digest):
        raise RunMismatch(
            f"{key}: the weights at {spec.model.path} changed since this run's first attempt "
            f"(checkpoint digest {first.model_digest}, now {mine.model_digest}); "
            f"partitions would mix two models. Extract into a new run directory, or restore "
            f"the original checkpoint")
    if first.identity() != mine.identity():
        raise RunMismatch(f"{key}: activations were written for {_shown(first)}, but this "
                          f"worker would write {_shown(mine)}")
    if (first.numerics is not None and not first.numerics.same_bytes_as(mine.numerics)
            and not allow_numerics_change):
        raise RunMismatch(
            f"{key}: the run's activations were computed with {_shown(first.numerics)}, "
            f"this worker would use {_shown(mine.numerics)}; a rerun only rewrites identical "
            f"bytes with the same device kind, jax version, rows per device, model "
            f"parallelism and attention implementation. Match them (`actx rerun` launches "
            f"with the batch size the run's activations were computed with, unless "
            f"--batch-size says otherwise), or accept partitions that differ in their low "
            f"bits: `allow_numerics_change: true` in the config's target table (the "
            f"worker's --allow-numerics-change)")


def _shown(obj) -> dict | None:
    """A record as the user knows it from the JSON file."""
    if obj is None:
        return None
    data = config_lib.to_dict(obj)
    return {k: v for k, v in data.items() if k != "numerics"} if "numerics" in data else data

"""A user's Flax NNX model (workers/flax/), in process: every hook equals the model's own
sown intermediate bit for bit in fp32 (same rows per device), weights follow the model's
own sharding annotations, packing the model cannot serve and unknown paths are refused
with what to do. The models are tests/flax_models.py."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from actx.schemas import generate_spec
from actx.schemas import runspec
from tests import flax_models
from actx.workers.flax import model as flax_model, preflight as flax_preflight, step as flax_step
from actx.workers.model import sharding

HOOKS = "blocks.*:output,blocks.*.mlp:output,blocks.*.attn:input"
B, T = 8, 12


def _packed_rows():
    """Two documents per row (segment ids 1, 2), positions restarting, padding at the end."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, flax_models.VOCAB, (B, T)).astype(np.int32)
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    for r in range(B):
        first, second = 3 + r % 4, 4 + r % 3
        seg[r, :first], seg[r, first:first + second] = 1, 2
        pos[r, :first] = np.arange(first)
        pos[r, first:first + second] = np.arange(second)
    return ids, pos, seg


@nnx.jit
def _sown(model, ids, pos, seg):
    return flax_models.sown(model, ids, positions=pos, segment_ids=seg)


def _sown_per_row(model, ids, pos, seg):
    """The model's own intermediates, one row per call (as one row per device runs)."""
    rows = [_sown(model, ids[r:r + 1], pos[r:r + 1], seg[r:r + 1]) for r in range(len(ids))]
    return {k: np.concatenate([np.asarray(row[k]) for row in rows]) for k in rows[0]}


def test_every_hook_equals_the_models_own_intermediate_bit_for_bit():
    model = flax_models.make_masked_decoder()
    ids, pos, seg = _packed_rows()
    mesh = sharding.make_mesh(data=8, model=1)
    fn = flax_step.make_flax_extract_fn(model, HOOKS, mesh, dtype="float32")
    out = fn(ids, pos, seg)
    expected = _sown_per_row(model, ids, pos, seg)
    assert sorted(out) == sorted(expected) == fn.hook_names
    assert len(expected) == 3 * flax_models.LAYERS
    for name, want in expected.items():
        got = np.asarray(out[name])
        assert got.dtype == np.float32 and got.shape == (B, T, flax_models.D)
        np.testing.assert_array_equal(got, want, err_msg=name)
    # The segments are kept apart: the second document of a row sees none of the first.
    alone = _sown(model, ids[:1, 3:3 + 4], pos[:1, 3:3 + 4], np.ones((1, 4), np.int32))
    np.testing.assert_allclose(np.asarray(out["blocks.2:output"])[0, 3:7],
                               np.asarray(alone["blocks.2:output"])[0], rtol=1e-5, atol=1e-5)
    assert fn.trace_count == 1
    fn(ids, pos, seg)
    assert fn.trace_count == 1 and fn.compile_count() == 1


def test_the_step_drops_what_no_hook_needs():
    """Hooks in block 0 only: the compiled step computes no LM head ([b, t, vocab] logits)
    and no later block; the model's own jitted call does both."""
    model = flax_models.make_masked_decoder()
    ids, pos, seg = _packed_rows()
    fn = flax_step.make_flax_extract_fn(model, "blocks.0.mlp:output")
    hlo = fn._jitted.lower(fn.model.state, ids, pos, seg).compile().as_text()
    own = nnx.jit(lambda m, i, p, s: nnx.capture(m, nnx.Intermediate)(
        i, positions=p, segment_ids=s)[0]).lower(model, ids, pos, seg).compile().as_text()
    logits = f"f32[{B},{T},{flax_models.VOCAB}]"
    assert logits in own and logits not in hlo
    assert hlo.count("tanh") < own.count("tanh")  # gelu of one MLP, not of every block


def test_a_model_taking_an_attention_mask_gets_the_block_diagonal_causal_one():
    model = flax_models.make_attention_mask_decoder()
    ids, pos, seg = _packed_rows()
    out = flax_step.make_flax_extract_fn(model, HOOKS, sharding.make_mesh(data=8, model=1))(
        ids, pos, seg)
    # The mask written out here: causal, within one segment; padding sees earlier padding.
    causal = np.tril(np.ones((T, T), bool))
    mask = (causal[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]

    @nnx.jit
    def sown(model, ids, pos, mask):
        return flax_models.sown(model, ids, positions=pos, attention_mask=mask)

    for r in range(B):
        want = sown(model, ids[r:r + 1], pos[r:r + 1], mask[r:r + 1])
        assert sorted(want) == sorted(out)
        for name in want:
            np.testing.assert_array_equal(np.asarray(out[name])[r], np.asarray(want[name])[0],
                                          err_msg=f"{name} row {r}")


def test_one_call_without_a_mesh_equals_one_jitted_call_of_the_model():
    model = flax_models.make_plain_decoder()
    ids = np.random.default_rng(1).integers(1, flax_models.VOCAB, (4, T)).astype(np.int32)
    out = flax_step.make_flax_extract_fn(model, "blocks.1:output,blocks.0.attn:input")(ids)
    expected = nnx.jit(lambda m, x: flax_models.sown(m, x))(model, ids)
    assert sorted(out) == ["blocks.0.attn:input", "blocks.1:output"]
    for name, got in out.items():
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected[name]), err_msg=name)


def test_weights_follow_the_models_own_annotations_on_the_model_axis():
    model = flax_models.make_masked_decoder()
    mesh = sharding.make_mesh(data=4, model=2)
    loaded = flax_model.load(model, mesh)
    specs = {k: s.spec for k, s in flax_model._flat(loaded.state_shardings)}
    assert specs["blocks.0.mlp.up.kernel.value"] == PartitionSpec(None, "model")
    assert specs["blocks.0.mlp.down.kernel.value"] == PartitionSpec("model", None)
    assert specs["embed.embedding.value"] == PartitionSpec("model", None)
    assert specs["pos_embed.embedding.value"] == PartitionSpec(None, None)  # replicated
    up = loaded.state["blocks"][0]["mlp"]["up"]["kernel"][...]
    assert up.addressable_shards[0].data.shape == (flax_models.D, flax_models.MLP // 2)
    ids, pos, seg = _packed_rows()
    out = flax_step.FlaxExtractFn(loaded, flax_model_hooks(loaded, HOOKS), mesh)(ids, pos, seg)
    expected = _sown(model, ids, pos, seg)
    for name, want in expected.items():
        # Sums split over the model axis add in another order: close, not bit-equal.
        np.testing.assert_allclose(np.asarray(out[name]), np.asarray(want), rtol=1e-5,
                                   atol=1e-5, err_msg=name)


def test_annotations_name_mesh_axes_or_actx_logical_axes():
    mesh = sharding.make_mesh(data=4, model=2)
    spec = sharding.annotation_spec
    assert spec(("model", None), (8, 3), mesh) == PartitionSpec("model", None)
    assert spec(("mlp", "embed"), (8, 3), mesh) == PartitionSpec("model", None)
    assert spec(("heads", "mlp"), (8, 4), mesh) == PartitionSpec("model", None)  # used once
    assert spec(("mlp",), (7,), mesh) == PartitionSpec(None)        # 2 does not divide 7
    assert spec(("experts", "model"), (4, 6), mesh) == PartitionSpec(None, "model")
    assert spec((), (4, 6), mesh) == PartitionSpec(None, None)


def flax_model_hooks(loaded, text):
    from actx.workers.flax import hooks as flax_hooks

    return flax_hooks.parse_hooks(text, loaded.paths)


def test_an_unknown_path_is_refused_with_the_nearest_existing_ones():
    model = flax_models.make_plain_decoder()
    with pytest.raises(ValueError) as e:
        flax_step.make_flax_extract_fn(model, "blocks.1.mlpp:output")
    assert "no submodule 'blocks.1.mlpp'" in str(e.value)
    assert "nearest existing: blocks.1.mlp" in str(e.value)
    with pytest.raises(ValueError, match=r"no submodule 'blocks.3' \(nearest existing: "):
        flax_step.make_flax_extract_fn(model, "blocks.0-3:output")
    with pytest.raises(ValueError, match="did you mean 'input'"):
        flax_step.make_flax_extract_fn(model, "blocks.0.attn:inptu")


def _spec(factory: str, mode: str, overflow: str = "truncate",
          hooks: str = "blocks.*:output") -> runspec.RunSpec:
    return runspec.RunSpec(
        model=runspec.ModelSpec(flax=factory), tokenizer=runspec.TokenizerSpec(path="tok"),
        sources=(runspec.SourceSpec(kind="text", paths=("x.jsonl",)),),
        packing=runspec.PackingSpec(mode=mode, seq_len=16, overflow=overflow),
        capture=runspec.CaptureConfig(hooks=hooks, dtype="float32"))


PLAIN, MASKED = "tests.flax_models:make_plain_decoder", "tests.flax_models:make_masked_decoder"


@pytest.mark.parametrize("factory,mode,overflow,refused", [
    (PLAIN, "pad", "truncate", None),
    (PLAIN, "segmented", "truncate", 'packing.mode="segmented"'),
    (PLAIN, "concat", "truncate", 'packing.mode="concat"'),
    (PLAIN, "pad", "continue", 'packing.overflow="continue"'),
    (MASKED, "segmented", "truncate", None),
    (MASKED, "concat", "truncate", None),
    (MASKED, "pad", "truncate", None),
    (MASKED, "segmented", "continue", 'packing.overflow="continue"'),
])
def test_packing_the_model_cannot_serve_is_refused_by_name(factory, mode, overflow, refused):
    check = flax_preflight.check_job(_spec(factory, mode, overflow))
    if refused is None:
        assert check.problems == ()
    else:
        assert len(check.problems) == 1 and refused in check.problems[0], check.problems
        assert 'use packing.mode="pad"' in check.problems[0] \
            or 'packing.overflow="truncate"' in check.problems[0]
    assert check.vocab_size == flax_models.VOCAB


def test_preflight_names_a_missing_path_and_a_missing_factory():
    check = flax_preflight.check_job(_spec(MASKED, "pad", hooks="blocks.1.atn:input"))
    assert len(check.problems) == 1
    assert check.problems[0].startswith(
        "spec.capture.hooks: hook 'blocks.1.atn:input': the model has no submodule "
        "'blocks.1.atn' (nearest existing: blocks.1.attn, ")
    check = flax_preflight.check_job(_spec("tests.flax_models:make_nothing", "pad"))
    assert "tests.flax_models has no 'make_nothing'" in check.problems[0]


def test_a_factory_may_name_its_tokenizer_and_the_spec_must_agree():
    spec = _spec("tests.flax_models:make_plain_decoder_with_tokenizer", "pad")
    check = flax_preflight.check_job(spec)
    assert check.problems == (
        "spec.tokenizer.path: tests.flax_models:make_plain_decoder_with_tokenizer names its "
        "tokenizer '/models/plain/tokenizer', the spec 'tok'; set spec.tokenizer.path to "
        "'/models/plain/tokenizer'",)
    agreed = runspec.RunSpec(**{**spec.__dict__, "tokenizer": runspec.TokenizerSpec(
        path="/models/plain/tokenizer/")})
    assert flax_preflight.check_job(agreed).problems == ()
    loaded = flax_model.load("tests.flax_models:make_plain_decoder_with_tokenizer")
    assert loaded.vocab_size == flax_models.VOCAB


def test_model_flax_keeps_old_fingerprints_and_round_trips():
    old = runspec.RunSpec(model=runspec.ModelSpec(path="m"),
                          tokenizer=runspec.TokenizerSpec(path="t"),
                          sources=(runspec.SourceSpec(kind="text", paths=("x",)),))
    assert "flax" not in old.to_dict()["model"]
    flax_spec = _spec(MASKED, "pad")
    assert flax_spec.to_dict()["model"]["flax"] == MASKED
    assert runspec.RunSpec.from_dict(flax_spec.to_json_obj()) == flax_spec
    with pytest.raises(ValueError, match="give one"):
        runspec.ModelSpec(path="m", flax=MASKED)


def test_a_generating_run_is_refused_for_a_flax_model_by_name():
    from actx.workers import preflight

    spec = _spec(MASKED, "segmented", "continue")
    generating = runspec.RunSpec(**{**spec.__dict__,
                                    "generate": generate_spec.GenerateSpec(max_new_tokens=4)})
    problems = preflight.check_job(generating).problems
    assert f"spec.generate: {preflight.FLAX_GENERATES}" in problems, problems
    assert not any("spec.generate" in p for p in preflight.check_job(spec).problems)

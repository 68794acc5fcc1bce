"""TransformerLens hook names (schemas.hook_aliases): accepted as the actx hooks of equal
value in a run's capture.hooks, CaptureSpec.parse and the reader; refused by name, with
the reason, where TransformerLens's value differs on the model; the run stores actx's
names and describe() shows both."""

from __future__ import annotations

import json

import numpy as np
import pytest

from actx import reader
from actx.schemas import activations_info as info_lib
from actx.schemas import hook_aliases, layout, runspec
from actx.schemas import store as store_lib
from actx.workers.model import capture, families, step
from actx.workers.model import decoder as model_lib
from tests import hf_models
from tests.reader_fixtures import build_run


def _config(arch: str, **overrides):
    """The ModelConfig of hf_models' tiny `arch`, from its config dict alone."""
    import transformers

    hf = hf_models.tiny_config(arch, **overrides).to_dict()
    hf["architectures"] = [transformers.models.auto.modeling_auto
                           .MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf["model_type"]]]
    return families.config_from_hf(hf)


def test_the_architecture_sets_match_the_families():
    """The LayerNorm and learned-position architectures schemas names (it imports no
    family) are exactly those whose configs say so."""
    configs = [_config(arch) for arch in hf_models.ARCHS + hf_models.GPT_ARCHS
               + hf_models.MOE_LAYOUT_ARCHS + hf_models.OSS_ARCHS if arch != "gemma3_mm"]
    assert {c.architecture for c in configs} >= {
        a for f in families.FAMILIES for a in f.architectures
        if a != "Gemma3ForConditionalGeneration"}
    assert {c.architecture for c in configs if c.layer_norm} == \
        hook_aliases.LAYER_NORM_ARCHITECTURES
    assert {c.architecture for c in configs if c.learned_positions} == \
        hook_aliases.LEARNED_POSITION_ARCHITECTURES


def test_parse_reads_them_as_the_actx_hooks():
    tl = capture.CaptureSpec.parse("blocks.0-1.hook_resid_pre,blocks.2.hook_mlp_out,"
                                   "blocks.*.hook_attn_out,blocks.1.hook_resid_mid,"
                                   "blocks.0.hook_resid_post,hook_embed")
    ours = capture.CaptureSpec.parse("layers.0-1.resid_pre,layers.2.mlp_out,"
                                     "layers.*.attn_out,layers.1.resid_mid,"
                                     "layers.0.resid_post,embed")
    assert tl.point_layers(3) == ours.point_layers(3)
    assert tl.global_points() == ours.global_points()
    assert tl.hook_names(3) == ours.hook_names(3)  # the run stores actx's names
    tl.validate(_config("qwen2"))


@pytest.mark.parametrize("name,pattern", [
    ("ln_final.hook_normalized", r"'ln_final\.hook_normalized' has no equal actx hook: "
                                 r"TransformerLens folds the final LayerNorm"),
    ("hook_pos_embed", r"'hook_pos_embed' has no equal actx hook"),
    ("blocks.0.ln1.hook_normalized", r"no equal actx hook; accepted TransformerLens "
                                     r"names: blocks\.<i>\.hook_resid_pre"),
    ("blocks.0.attn.hook_z", r"'blocks\.0\.attn\.hook_z' has no equal actx hook"),
])
def test_names_without_an_equal_value_are_refused_by_name(name, pattern):
    with pytest.raises(ValueError, match=pattern):
        capture.CaptureSpec.parse(f"layers.0.resid_post,{name}")


@pytest.mark.parametrize("arch,name,pattern", [
    ("gpt2", "blocks.1.hook_resid_pre", r"'blocks\.1\.hook_resid_pre' is not actx's "
                                        r"layers\.1\.resid_pre for GPT2LMHeadModel: .*"
                                        r"center_writing_weights"),
    ("gpt_neox", "blocks.0.hook_mlp_out", r"GPTNeoXForCausalLM: .*center_writing_weights"),
    ("gpt2", "hook_embed", r"'hook_embed' is not actx's embed for GPT2LMHeadModel: it is "
                           r"the token embedding alone"),
])
def test_layer_norm_models_refuse_them_with_the_reason(arch, name, pattern):
    """TransformerLens centres a LayerNorm model's residual stream, and GPT-2's hook_embed
    has no positions: not actx's values, so refused, not approximated."""
    spec = capture.CaptureSpec.parse(name)
    with pytest.raises(ValueError, match=pattern):
        spec.validate(_config(arch))


@pytest.mark.parametrize("name", ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_post",
                                  "blocks.0.hook_attn_out", "blocks.*.hook_mlp_out"])
def test_gpt_oss_refuses_them_past_the_embedding(name):
    """TransformerLens's gpt-oss has no attention sinks: from the first attention on its
    values are not HF's (actx's), so refused with the reason; its hook_embed (the token
    embedding, as actx's) stays, and the reader names no TransformerLens alias past it."""
    with pytest.raises(ValueError, match=r"GptOssForCausalLM: TransformerLens's gpt-oss "
                                         r"leaves out the attention sinks"):
        capture.CaptureSpec.parse(name).validate(_config("gpt_oss"))
    capture.CaptureSpec.parse("hook_embed").validate(_config("gpt_oss"))
    assert hook_aliases.transformer_lens_name("layers.0.resid_post",
                                              "GptOssForCausalLM") is None
    assert hook_aliases.transformer_lens_name("embed", "GptOssForCausalLM") == "hook_embed"
    assert hook_aliases.transformer_lens_name("layers.0.resid_post",
                                              "Qwen2ForCausalLM") == "blocks.0.hook_resid_post"


@pytest.mark.parametrize("arch, overrides, why", [
    ("phi3", {}, r"rotates every dim of a head; this model rotates 0\.5 of them"),
    ("phi3_longrope", {}, r"rotates every dim of a head"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 1.0}}, None),  # Phi-3-mini-4k's
])
def test_a_phi3_whose_rope_transformer_lens_does_not_model_refuses_them(arch, overrides,
                                                                         why):
    """TransformerLens's Phi-3 config rotates every head dim at rope_theta and reads no
    rope_scaling (Phi-4-mini rotates 0.75, Phi-3.5 and the 128k models use longrope):
    there its values past the embedding are not HF's, so its names are refused by the
    checkpoint's own settings; a Phi-3 it models exactly keeps them."""
    config = _config(arch, **overrides)
    spec = capture.CaptureSpec.parse("blocks.0.hook_resid_post,hook_embed")
    if why is None:
        spec.validate(config)
        assert capture.transformer_lens_difference(config) is None
        return
    with pytest.raises(ValueError, match=r"'blocks\.0\.hook_resid_post' is not actx's "
                                         r"layers\.0\.resid_post for Phi3ForCausalLM: "
                                         r"TransformerLens's Phi-3 " + why):
        spec.validate(config)
    capture.CaptureSpec.parse("hook_embed").validate(config)
    assert hook_aliases.model_difference("Phi3ForCausalLM", "longrope", 1.0) == (
        "TransformerLens's Phi-3 reads no rope_scaling; this model's RoPE is 'longrope'")
    assert hook_aliases.model_difference("LlamaForCausalLM", "longrope", 0.5) is None


def test_a_run_records_where_transformer_lens_differs_and_the_reader_refuses_them(
        tmp_path):
    """A worker on a Phi-3 with partial rotary records why in activations/actx.json; the
    reader of that run then refuses TransformerLens names past the embedding and names
    none in describe(); a run whose record has no such reason reads them as before."""
    from tests import token_runs, worker_procs

    model = hf_models.make_tiny_checkpoint(tmp_path / "phi3", "phi3")
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, model, n_rows=8, hooks="layers.0.resid_post,embed",
                               partition_rows=8)
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "4"])
    assert code == 0, out
    with open(f"{run}/{layout.ACTIVATIONS_INFO_KEY}") as f:
        recorded = json.load(f)
    assert recorded["architecture"] == "Phi3ForCausalLM"
    assert recorded["transformer_lens_differs"].startswith("TransformerLens's Phi-3 rotates")
    opened = reader.open_run(run)
    with pytest.raises(ValueError, match=r"TransformerLens's Phi-3 rotates every dim"):
        opened.batches("blocks.0.hook_resid_post", 4)
    assert opened.resolve_hook("hook_embed") == "embed"
    hooks = opened.describe()["hooks"]
    assert hooks["layers.0.resid_post"]["transformer_lens"] is None
    assert hooks["embed"]["transformer_lens"] == "hook_embed"
    truth = build_run(str(tmp_path / "plain"))
    _record_architecture(truth.uri, "Phi3ForCausalLM")
    assert reader.open_run(truth.uri).resolve_hook("blocks.0.hook_resid_post") == \
        "layers.0.resid_post"


def test_extraction_by_either_name_is_the_same(tmp_path):
    path = hf_models.make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    model = model_lib.load_pretrained(path)
    ids = np.random.RandomState(0).randint(1, 512, (2, 12)).astype(np.int32)
    tl = step.make_extract_fn(model, capture.CaptureSpec.parse(
        "blocks.1.hook_resid_pre,blocks.2.hook_attn_out,hook_embed"))(ids)
    ours = step.make_extract_fn(model, capture.CaptureSpec.parse(
        "layers.1.resid_pre,layers.2.attn_out,embed"))(ids)
    assert sorted(tl) == sorted(ours) == ["embed", "layers.1.resid_pre", "layers.2.attn_out"]
    for name in ours:
        np.testing.assert_array_equal(np.asarray(tl[name]), np.asarray(ours[name]))


def test_the_pre_flight_refuses_them_where_unequal(tmp_path):
    from actx.workers import preflight

    def problems(arch):
        path = hf_models.make_tiny_checkpoint(tmp_path / arch, arch)
        spec = runspec.RunSpec.from_dict({
            "model": {"path": path}, "tokenizer": {"path": "unused"},
            "sources": [{"kind": "text", "paths": ["none.jsonl"]}],
            "packing": {"mode": "segmented", "seq_len": 32, "overflow": "truncate"},
            "capture": {"hooks": "blocks.0.hook_resid_post"}})
        return preflight.check_job(spec, batch_size=1).problems

    assert not any("TransformerLens" in p for p in problems("qwen2"))
    assert any(p.startswith("spec.capture.hooks: TransformerLens hook "
                            "'blocks.0.hook_resid_post' is not actx's layers.0.resid_post "
                            "for GPT2LMHeadModel") for p in problems("gpt2"))


def _record_architecture(uri: str, architecture: str | None) -> None:
    store = store_lib.open_store(uri)
    info = info_lib.read_info(store)
    store.write_json(layout.ACTIVATIONS_INFO_KEY, info_lib._record(
        info_lib.ActivationsInfo(**{**info.__dict__, "architecture": architecture})))


def test_the_record_keeps_the_architecture_only_where_known(tmp_path):
    store = store_lib.open_store(str(tmp_path / "s"))
    info = info_lib.ActivationsInfo(fingerprint="f", dtype="float32", hooks={"embed": 8})
    assert "architecture" not in info_lib._record(info)  # the earlier record, as it was
    info_lib.create_info(store, info.__class__(**{**info.__dict__,
                                                  "architecture": "Qwen2ForCausalLM"}))
    assert info_lib.read_info(store).architecture == "Qwen2ForCausalLM"


def test_the_reader_accepts_them_on_a_run_that_records_its_model(tmp_path):
    truth = build_run(str(tmp_path / "run"))
    _record_architecture(truth.uri, "Qwen2ForCausalLM")
    run = reader.open_run(truth.uri)
    assert run.hook("blocks.0.hook_resid_post").name == "layers.0.resid_post"
    assert run.resolve_hook("hook_embed") == "embed"
    hooks = run.describe()["hooks"]
    assert hooks["layers.0.resid_post"]["transformer_lens"] == "blocks.0.hook_resid_post"
    assert hooks["embed"]["transformer_lens"] == "hook_embed"
    by_tl = next(iter(run.batches("blocks.0.hook_resid_post", 32, seed=0)))
    by_ours = next(iter(run.batches("layers.0.resid_post", 32, seed=0)))
    np.testing.assert_array_equal(by_tl.acts["layers.0.resid_post"],
                                  by_ours.acts["layers.0.resid_post"])
    doc = run.document(0, ["blocks.0.hook_resid_post"])
    np.testing.assert_array_equal(doc.acts["layers.0.resid_post"],
                                  run.document(0, ["layers.0.resid_post"]).acts[
                                      "layers.0.resid_post"])


def test_the_reader_refuses_them_where_unequal(tmp_path):
    """A run that records no architecture (written before actx recorded it, when every
    family it read was RMSNorm) reads them; a LayerNorm model's run refuses them."""
    truth = build_run(str(tmp_path / "run"))
    run = reader.open_run(truth.uri)
    assert run.architecture is None
    assert run.hook("blocks.0.hook_resid_post").name == "layers.0.resid_post"
    assert run.describe()["hooks"]["embed"]["transformer_lens"] == "hook_embed"
    _record_architecture(truth.uri, "GPTNeoXForCausalLM")
    run = reader.open_run(truth.uri)
    with pytest.raises(ValueError, match=r"center_writing_weights"):
        run.batches("blocks.0.hook_resid_post", 32)
    assert run.describe()["hooks"]["embed"]["transformer_lens"] is None


def test_the_torch_dataset_reads_them_too(tmp_path):
    from actx.reader import torch_data

    truth = build_run(str(tmp_path / "run"))
    _record_architecture(truth.uri, "LlamaForCausalLM")
    run = reader.open_run(truth.uri)
    by_tl = torch_data.ActivationDataset(run, "blocks.0.hook_resid_post", 16, epochs=1,
                                         seed=0)
    by_ours = torch_data.ActivationDataset(run, "layers.0.resid_post", 16, epochs=1, seed=0)
    for a, b in zip(by_tl, by_ours):
        np.testing.assert_array_equal(a.numpy(), b.numpy())

"""A config.json is read as HF reads it, field by field: what it leaves out takes the HF
config class's default (workers/model/families/hf_defaults.py), RoPE's pretraining context
is picked as HF's `standardize_rope_params` picks it, and a field HF's model does not use
(Gemma 3's attn_logit_softcapping) changes nothing. The reference is transformers itself:
its own completion of a config, and its model's hidden states."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from actx.workers.model import families
from actx.workers.model.families import hf_defaults
from tests import hf_models

# The tiny configs of every family (tests/hf_models.py) and the class HF reads each with.
ARCHS = ("qwen2", "llama3", "mistral", "qwen3", "gemma2", "gemma3", "phi3", "phi3_longrope",
         "olmo2", "qwen3_moe", "qwen2_moe", "qwen3_moe_mixed", "olmoe", "mixtral", "gpt2",
         "gpt_neox", "gpt_oss")
# Fields whose absence no reader can complete: what the checkpoint is.
NOT_DROPPED = {"architectures", "model_type", "transformers_version", "dtype", "torch_dtype"}


def _saved(arch: str) -> dict:
    """The config.json save_pretrained writes for the tiny `arch`."""
    import transformers

    config = hf_models.tiny_config(arch)
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    saved = json.loads(config.to_json_string())
    saved["architectures"] = [model_class.__name__]
    return saved


def _read(hf: dict):
    try:
        return families.config_from_hf(hf)
    except (ValueError, KeyError) as e:
        return type(e)


def test_the_defaults_table_is_transformers_own():
    """Every default actx fills in is the installed transformers' class default (a new
    transformers that changes one fails here, naming it)."""
    import transformers

    for arch, table in hf_defaults.DEFAULTS.items():
        config_class = getattr(transformers, arch).config_class
        field_defaults = {f.name: f.default for f in dataclasses.fields(config_class)}
        for field, value in table.items():
            if field == "rope_theta":
                assert getattr(config_class, "default_theta") == value, (arch, field)
            else:
                assert field_defaults.get(field) == value, (arch, field, value)
        aliases = {k: v for k, v in config_class.attribute_map.items() if "token" not in k}
        ours = {**hf_defaults.ALIASES.get(arch, {}),
                **families.for_architecture(arch).hf_names}
        assert ours == aliases, arch


@pytest.mark.parametrize("arch", ARCHS)
def test_a_field_left_out_reads_as_hf_completes_it(arch):
    """Drop each field of a saved config in turn: actx reads the same model from the
    shortened config.json as from HF's own reading of it (the class's defaults and its
    derived fields written out), or refuses both."""
    saved = _saved(arch)
    config_class = type(hf_models.tiny_config(arch))
    assert _read(saved) == _read(json.loads(config_class.from_dict(saved).to_json_string())
                                 | {"architectures": saved["architectures"]})
    checked = 0
    for field in sorted(set(saved) - NOT_DROPPED):
        dropped = {k: v for k, v in saved.items() if k != field}
        try:
            completed = config_class.from_dict(dict(dropped))
        except Exception:  # noqa: BLE001 - HF itself cannot read it; nothing to compare
            continue
        as_hf = json.loads(completed.to_json_string()) | {"architectures":
                                                          saved["architectures"]}
        ours, theirs = _read(dropped), _read(as_hf)
        assert ours == theirs, f"{arch}: without {field}: {ours} != {theirs}"
        checked += 1
    assert checked >= 15


def _hidden_states(path, seq: int = 24):
    import actx
    from actx.workers.model import sharding

    mesh = sharding.make_mesh(data=-1, model=1)
    ids = np.random.default_rng(0).integers(1, 512, (mesh.shape["data"], seq)).astype(np.int32)
    ref = hf_models.hf_hooks(hf_models.load_hf_model(path), ids)
    model = actx.load_pretrained(path, dtype="float32", mesh=mesh)
    spec = actx.CaptureSpec.parse("layers.*.resid_post,final_norm", dtype="float32")
    ours = actx.make_extract_fn(model, spec, mesh)(ids)
    return {k: float(np.max(np.abs(np.asarray(v, np.float32) - ref[k]))) for k, v in ours.items()}


def _edited_checkpoint(tmp_path, arch: str, edit, **overrides) -> str:
    path = hf_models.make_tiny_checkpoint(tmp_path / arch, arch, **overrides)
    config_path = tmp_path / arch / "config.json"
    config = json.loads(config_path.read_text())
    edit(config)
    config_path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("case", ["llama3_top_level_context", "phi3_top_level_context",
                                  "phi3_class_default_context", "gemma3_softcap",
                                  "olmo2_no_eps", "gemma2_no_query_scalar"])
def test_hidden_states_equal_hf_where_config_json_is_hand_written(tmp_path, case):
    """Configs save_pretrained does not write but people do: a top-level pretraining
    context that disagrees with the rope parameters' (HF takes the top-level one), Phi-3's
    with none (its class says 4096), Gemma 3 with attn_logit_softcapping set (HF's Gemma 3
    never applies it), fields left out (HF's class defaults). Each case moves HF's own
    hidden states; actx's equal them."""
    if case == "llama3_top_level_context":
        path = _edited_checkpoint(tmp_path, "llama3",
                                  lambda c: c.update(original_max_position_embeddings=16))
    elif case == "phi3_top_level_context":
        path = _edited_checkpoint(tmp_path, "phi3_longrope",
                                  lambda c: c.update(original_max_position_embeddings=64))
    elif case == "phi3_class_default_context":
        path = _edited_checkpoint(tmp_path, "phi3_longrope",
                                  lambda c: c.pop("original_max_position_embeddings"))
    elif case == "gemma3_softcap":
        path = _edited_checkpoint(tmp_path, "gemma3",
                                  lambda c: c.update(attn_logit_softcapping=3.0))
    elif case == "olmo2_no_eps":
        path = _edited_checkpoint(tmp_path, "olmo2", lambda c: c.pop("rms_norm_eps"))
    else:
        path = _edited_checkpoint(tmp_path, "gemma2", lambda c: c.pop("query_pre_attn_scalar"))
    diffs = _hidden_states(path)
    assert max(diffs.values()) < 1e-4, diffs

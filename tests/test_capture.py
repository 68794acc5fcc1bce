"""CaptureSpec: parsing, hook names and validation messages."""

from __future__ import annotations

import dataclasses

import pytest

from actx.workers.model import capture
from actx.workers.model.capture import CaptureSpec


@dataclasses.dataclass(frozen=True)
class _Cfg:
    num_layers: int = 6


def test_constructor_form():
    spec = CaptureSpec(hooks=["resid_post", "embed"], layers=[3, 1])
    assert spec.layers == (1, 3)
    assert spec.hook_names(6) == ["embed", "layers.1.resid_post", "layers.3.resid_post"]
    assert CaptureSpec(hooks=["mlp_out"]).hook_names(2) == ["layers.0.mlp_out",
                                                           "layers.1.mlp_out"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.dtype = "bfloat16"


def test_parse_ranges_indices_stars_and_globals():
    spec = CaptureSpec.parse("layers.0-2.resid_post, layers.5.attn_out,layers.*.mlp_out,"
                             "final_norm,embed,layers.4.resid_post", dtype="bfloat16")
    assert spec.dtype == "bfloat16"
    assert spec.point_layers(6) == {"resid_post": (0, 1, 2, 4), "attn_out": (5,),
                                    "mlp_out": (0, 1, 2, 3, 4, 5)}
    assert spec.hook_names(6) == sorted(
        ["embed", "final_norm", "layers.5.attn_out"]
        + [f"layers.{i}.resid_post" for i in (0, 1, 2, 4)]
        + [f"layers.{i}.mlp_out" for i in range(6)])
    assert CaptureSpec.parse(["final_norm"]).hook_names(6) == ["final_norm"]


def test_parse_is_faithful_to_per_point_layer_sets():
    spec = CaptureSpec.parse("layers.0-3.resid_post,final_norm")
    assert spec.hook_names(4) == ["final_norm"] + [f"layers.{i}.resid_post" for i in range(4)]
    assert "layers.0.attn_out" not in CaptureSpec.parse(
        "layers.0.resid_post,layers.1.attn_out").hook_names(4)


def test_layer_out_of_range():
    spec = CaptureSpec.parse("layers.6.resid_post")
    with pytest.raises(ValueError, match=r"layer index 6 out of range.*6 layers \(0\.\.5\)"):
        spec.validate(_Cfg())
    with pytest.raises(ValueError, match="out of range"):
        CaptureSpec(hooks=["attn_out"], layers=[0, 9]).hook_names(6)


@pytest.mark.parametrize("text,suggestion", [
    ("layers.1.resid_psot", "resid_post"),
    ("layers.1.attn_output", "attn_out"),
    ("final_nrom", "final_norm"),
])
def test_misspelt_hook_suggests_closest(text, suggestion):
    with pytest.raises(ValueError, match=f"did you mean '{suggestion}'"):
        CaptureSpec.parse(text)


def test_misspelt_hook_in_constructor_and_bad_dtype():
    with pytest.raises(ValueError, match="did you mean 'mlp_out'"):
        CaptureSpec(hooks=["mlp_outt"])
    with pytest.raises(ValueError, match="capture dtype 'int8'"):
        CaptureSpec(dtype="int8")
    with pytest.raises(ValueError, match="empty layer range"):
        CaptureSpec.parse("layers.3-1.resid_post")


# A suggestion for an unparseable hook keeps the user's own layers (index, range, `*`):
# following it must store exactly what was typed, only the misspelling corrected.
@pytest.mark.parametrize("text,fix,stored", [
    ("layer.1.resid_post", "layers.1.resid_post", ["layers.1.resid_post"]),
    ("layer.0-1.resid_post", "layers.0-1.resid_post",
     ["layers.0.resid_post", "layers.1.resid_post"]),
    ("layers.1.resid_pots", "layers.1.resid_post", ["layers.1.resid_post"]),
    ("lyers.*.mlp_out", "layers.*.mlp_out", [f"layers.{i}.mlp_out" for i in range(8)]),
    ("layers.2.hook_attn_out", "layers.2.attn_out", ["layers.2.attn_out"]),
    ("blocks.1.hook_resid_pots", "blocks.1.hook_resid_post", ["layers.1.resid_post"]),
    ("block.0-2.hook_resid_pre", "blocks.0-2.hook_resid_pre",
     [f"layers.{i}.resid_pre" for i in range(3)]),
    ("final_nrom", "final_norm", ["final_norm"]),
])
def test_hook_suggestion_names_the_layers_typed(text, fix, stored):
    with pytest.raises(ValueError) as e:
        CaptureSpec.parse(text)
    assert f"{fix!r}?)" in str(e.value)
    assert capture.hook_suggestion(text) == fix
    assert sorted(CaptureSpec.parse(fix).hook_names(8)) == sorted(stored)


@pytest.mark.parametrize("text", [
    "banana", "resid_post", "layers.1.mlp_in", "blocks.1.hook_mlp_in", "hook_pos_embed",
    "foo.1.resid_post", "layers.0:3.resid_post", "layers.1.2.resid_post",
    "layers.1.resid_p",  # resid_pre or resid_post: no guess between two points
])
def test_hopeless_hook_gets_no_suggestion(text):
    assert capture.hook_suggestion(text) is None
    with pytest.raises(ValueError) as e:
        CaptureSpec.parse(text)
    assert "did you mean" not in str(e.value)

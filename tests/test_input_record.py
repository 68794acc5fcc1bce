"""A run already prepared for a config is not prepared again by `actx submit`; the config
names paths, not their contents. A fault audit changed the inputs under the same config
(a file added to the folder, a file appended to) and submitted again: "already prepared;
skipping", and the old tokens, without a word. Prepare now records each input file's
path and size (prepare/inputs.json), and the skip says what changed and that the run
keeps the old tokens. A real prepare (Beam's FnApiRunner) with the real Qwen vocabulary."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

from actx.deploy import local
from actx.pipeline import preflight
from actx.schemas import layout, runspec, store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _line(text: str) -> str:
    return json.dumps({"text": text}) + "\n"


def test_a_skipped_prepare_says_which_inputs_changed(tmp_path, qwen_tokenizer_dir):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text(_line("the first file") + _line("its second line"))
    (data / "b.jsonl").write_text(_line("the second file"))
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "actx.pipeline.main", "--out", str(run), "--tokenizer",
         qwen_tokenizer_dir, "--text", str(data), "--seq-len", "32", "--runner=FnApiRunner"],
        cwd=REPO, text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    s = store.open_store(str(run))
    recorded = s.read_json(layout.PREPARE_INPUTS_KEY)
    assert recorded == {"version": 1, "files": [
        [0, str(data / "a.jsonl"), os.path.getsize(data / "a.jsonl")],
        [0, str(data / "b.jsonl"), os.path.getsize(data / "b.jsonl")]]}
    spec = runspec.read_run_spec(s)

    def skipped() -> str:
        out = io.StringIO()
        assert local.prepare_local(spec, str(run), 0.0, out=out) is False
        return out.getvalue()

    said = skipped()
    assert "already prepared" in said and "changed" not in said, said
    # The same files: nothing to say. Then one appended to, one added, one removed.
    (data / "a.jsonl").write_text(_line("the first file") + _line("its second line")
                                  + _line("a third"))
    (data / "c.jsonl").write_text(_line("a new file"))
    os.remove(data / "b.jsonl")
    said = skipped()
    assert "prepare: note: the inputs changed since" in said, said
    assert f"{data / 'c.jsonl'} is new" in said and f"{data / 'b.jsonl'} is gone" in said
    assert (f"{data / 'a.jsonl'} is {os.path.getsize(data / 'a.jsonl'):,} bytes, was "
            f"{recorded['files'][0][2]:,}") in said
    assert "the run keeps the tokens of the inputs as they were then" in said


def test_many_changes_are_counted_and_an_unlisted_input_says_nothing(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    spec = runspec.RunSpec.from_dict({
        "model": {"path": "unused"}, "tokenizer": {"path": "unused"},
        "sources": [{"kind": "text", "paths": [str(data)]}],
        "packing": {"mode": "segmented", "seq_len": 32}})
    s = store.open_store(str(tmp_path / "run"))
    preflight.record_inputs(s, [])
    for i in range(8):
        (data / f"p-{i}.jsonl").write_text(_line(str(i)))
    said = preflight.inputs_changed(s, spec)
    assert said.count(" is new") == preflight.CHANGES_SHOWN and said.endswith(" and 3 more"), said
    # A run prepared before the record existed, or inputs that cannot be listed now (the
    # extraction does not read them): nothing to compare, nothing said.
    s.delete(layout.PREPARE_INPUTS_KEY)
    assert preflight.inputs_changed(s, spec) == ""
    preflight.record_inputs(s, [])
    for f in data.iterdir():
        f.unlink()
    data.rmdir()
    assert preflight.inputs_changed(s, spec) == ""

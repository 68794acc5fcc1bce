"""README's Python examples run as written (the extraction API on a tiny model)."""

from __future__ import annotations

import pathlib
import re
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_extraction_api_example_runs(monkeypatch):
    """Under `[demo]`, which has neither torch nor transformers: both are hidden here (an
    import of either raises ImportError, as it would there)."""
    text = README.read_text()
    section = text[text.index("### Extraction API (Python)"):]
    assert "pip install -e '.[demo]'" in section[:section.index("```python")]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    for name in ("torch", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)
    exec(compile(code, "README.md (extraction API)", "exec"), {})


def test_flax_model_example_runs():
    text = README.read_text()
    section = text[text.index("### Your own Flax model"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md (your own Flax model)", "exec"), {})


def test_every_python_block_is_run_by_a_test():
    """A block a reader would paste runs as written: the paragraph before it names the
    test that runs it (and what the test supplies, such as `run_dir`)."""
    text = README.read_text()
    blocks = [m.start() for m in re.finditer(r"^```python\n", text, re.M)]
    assert len(blocks) >= 6
    for start in blocks:
        before = " ".join(text[text.rfind("\n\n", 0, start - 2):start].split())
        assert "runs this block" in before, (
            f"README.md line {text.count(chr(10), 0, start) + 1}: a python block that no "
            f"test runs")

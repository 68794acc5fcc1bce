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


def _merged(base: dict, fragment: dict) -> dict:
    """The fragment's sections (spec, target, ...) over the base's, key by key: a key the
    fragment gives (spec.model, target.kind) replaces the base's whole."""
    return {**base, **{key: ({**base[key], **value} if isinstance(value, dict)
                             and isinstance(base.get(key), dict) else value)
                       for key, value in fragment.items()}}


def test_every_yaml_block_is_a_valid_submit_config(tmp_path):
    """README's config blocks, fragments included (merged onto the embedded demo config,
    as `--set` would), load as submit configs: no key is misspelt or out of date."""
    import textwrap

    import yaml

    from actx.deploy import config as deploy_config
    from actx.schemas import config as config_lib

    text = README.read_text()
    blocks = re.findall(r"^( *)```yaml\n(.*?)^ *```", text, re.S | re.M)
    assert len(blocks) >= 3
    demo = config_lib.load_file(deploy_config.DEMO_CONFIG)
    for i, (indent, body) in enumerate(blocks):
        fragment = yaml.safe_load(textwrap.dedent(body))
        path = tmp_path / f"block{i}.yaml"
        path.write_text(yaml.safe_dump(_merged(demo, fragment)))
        config = deploy_config.load_submit_config(str(path))
        for key in fragment.get("target", {}):
            assert hasattr(config.target, key), key

"""README and docs/: their examples run as written, every block is run or loaded by a test,
and every link between them resolves.

README.md is the front door and docs/*.md the rest (tests/test_readme_own_data.py runs
README's own-data walkthrough; tests/test_reader_readme.py, test_extractions_readme.py,
test_reader_trainers.py and test_verify_reference.py run the other pages' blocks)."""

from __future__ import annotations

import pathlib
import re
import shlex
import sys

from tests.setup_extras import setup_extras

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"


def pages() -> list[pathlib.Path]:
    """README and every page under docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def section(path: pathlib.Path, heading: str) -> str:
    """The text of `path` from `heading` to the next heading of the same or a higher level."""
    lines = path.read_text()[path.read_text().index(heading):].splitlines(keepends=True)
    level = len(heading) - len(heading.lstrip("#"))
    fenced = False
    for i, line in enumerate(lines[1:], 1):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and re.match(rf"#{{1,{level}}} ", line):  # not a comment in a block
            return "".join(lines[:i])
    return "".join(lines)


def blocks(text: str, lang: str) -> list[str]:
    """The fenced blocks of one language (indented fences included), dedented."""
    import textwrap

    return [textwrap.dedent(body) for body in
            re.findall(rf"^ *```{lang}\n(.*?)^ *```", text, re.S | re.M)]


def test_extraction_api_example_runs(monkeypatch):
    """Under `[demo]`, which has neither torch nor transformers: both are hidden here (an
    import of either raises ImportError, as it would there)."""
    text = section(DOCS / "models.md", "## Extraction API (Python)")
    assert "pip install -e '.[demo]'" in text[:text.index("```python")]
    [code] = blocks(text, "python")
    for name in ("torch", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)
    exec(compile(code, "docs/models.md (extraction API)", "exec"), {})


def test_flax_model_example_runs():
    [code] = blocks((DOCS / "flax.md").read_text(), "python")
    exec(compile(code, "docs/flax.md (your own Flax model)", "exec"), {})


def test_every_python_block_is_run_by_a_test():
    """A block a reader would paste runs as written: the paragraph before it names the
    test that runs it (and what the test supplies, such as `run_dir`), and that test reads
    the page."""
    count = 0
    for path in pages():
        text = path.read_text()
        for m in re.finditer(r"^```python\n", text, re.M):
            before = " ".join(text[text.rfind("\n\n", 0, m.start() - 2):m.start()].split())
            where = f"{path.relative_to(REPO)} line {text.count(chr(10), 0, m.start()) + 1}"
            assert "runs this block" in before, f"{where}: a python block that no test runs"
            named = re.findall(r"`(tests/test_\w+\.py)`", before) or re.findall(
                r"`(tests/test_\w+\.py)`", text[:m.start()])
            assert named, f"{where}: no test named before the block"
            assert path.name in (REPO / named[-1]).read_text(), (
                f"{where}: {named[-1]} does not read {path.name}")
            count += 1
    assert count >= 10


def _merged(base: dict, fragment: dict) -> dict:
    """The fragment's sections (spec, target, ...) over the base's, key by key: a key the
    fragment gives (spec.model, target.kind) replaces the base's whole."""
    return {**base, **{key: ({**base[key], **value} if isinstance(value, dict)
                             and isinstance(base.get(key), dict) else value)
                       for key, value in fragment.items()}}


def test_every_yaml_block_is_a_valid_submit_config(tmp_path):
    """The config blocks of README and docs/, fragments included (merged onto the embedded
    demo config, as `--set` would), load as submit configs: no key is misspelt or out of
    date."""
    import yaml

    from actx.deploy import config as deploy_config
    from actx.schemas import config as config_lib

    demo = config_lib.load_file(deploy_config.DEMO_CONFIG)
    count = 0
    for path in pages():
        for i, body in enumerate(blocks(path.read_text(), "yaml")):
            fragment = yaml.safe_load(body)
            file = tmp_path / f"{path.stem}-{i}.yaml"
            file.write_text(yaml.safe_dump(_merged(demo, fragment)))
            config = deploy_config.load_submit_config(str(file))
            for key in fragment.get("target", {}):
                assert hasattr(config.target, key), (path.name, key)
            count += 1
    assert count >= 4


def _check_shell_line(line: str, where: str, extras: dict, ci: str) -> None:
    from actx.deploy import cli

    words = shlex.split(line.split("  #")[0].strip())
    if words[:2] == ["pip", "install"]:
        for word in words[2:]:
            m = re.fullmatch(r"(?:-e )?(?:\.|actx-lm)\[([\w,]+)\]", word)
            if m:
                for extra in m.group(1).split(","):
                    assert extra in extras, f"{where}: no extra {extra!r} in setup.py"
            elif word.startswith("torch=="):
                assert word in extras["torch"] and word in extras["dev"], (
                    f"{where}: {word} is not the torch setup.py pins")
        return
    if words[:4] == ["python3", "-m", "pytest", "tests"]:
        [ci_line] = [c for c in ci.splitlines() if c.startswith("python3 -m pytest tests ")]
        assert [w for w in shlex.split(ci_line) if w not in ("-p", "no:cacheprovider")] \
            == words, f"{where}: not .ci/run's test command"
        return
    assert words[0] == "actx", f"{where}: a command no test checks: {line}"
    cli.build_parser().parse_args(words[1:])  # exits (SystemExit) on a flag it lacks


def test_every_shell_block_is_checked():
    """The bash/sh blocks: installs name extras that exist and the torch setup.py pins, the
    test command is .ci/run's, and every `actx` command parses with today's command line
    (the tests that run them as written: test_readme_own_data, test_extractions_readme,
    test_verify_reference, test_ops_submit)."""
    extras = setup_extras()
    ci = (REPO / ".ci" / "run").read_text()
    count = 0
    for path in pages():
        for lang in ("bash", "sh"):
            for body in blocks(path.read_text(), lang):
                for line in body.splitlines():
                    if line.strip() and not line.lstrip().startswith("#"):
                        _check_shell_line(line, f"{path.relative_to(REPO)}: {line}", extras,
                                          ci)
                        count += 1
    assert count >= 15


def test_the_torch_extra_brings_torch_and_datasets():
    extras = setup_extras()
    assert "torch==2.13.0" in extras["torch"]
    assert any(r.startswith("datasets") for r in extras["torch"])  # export_saelens


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_link_between_pages_resolves():
    """Relative links (README -> docs/, docs/ -> docs/) name a file that exists and, with
    #anchor, a heading it has; README stays a front door of about 250 lines at most."""
    assert len(README.read_text().splitlines()) <= 250
    for path in pages():
        text = re.sub(r"^ *```.*?^ *```", "", path.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            assert linked.exists(), f"{path.name}: link to {target}: no such file"
            if anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", linked.read_text(), re.M)
                slugs = {_slug(h) for h in headings}
                slugs |= {f"{s}-1" for s in slugs}
                assert anchor in slugs, f"{path.name}: link to {target}: no such heading"


def test_readme_links_every_page():
    text = README.read_text()
    for page in sorted(DOCS.glob("*.md")):
        assert f"(docs/{page.name}" in text, f"README does not link docs/{page.name}"

"""No message names a flag the command lacks (issue 66, item 5): every `--flag` in a
user-facing string of deploy/, pipeline/ and workers/ (a string with a space in it: a
message, a piece of advice, a help text; argument lists are single words) is checked
against the argparse parsers. Where the string names the command (`actx rerun RUN
--only ...`), the flag must be that command's; elsewhere it must be a flag of some actx
command or entry point (`python -m actx....`), or one of the other tools' flags listed
below, each with the tool it belongs to."""

from __future__ import annotations

import argparse
import ast
import os
import re

from actx.deploy import cli
from actx.pipeline import main as prepare_main
from actx.workers import main as workers_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9_-]*)")
COMMAND = re.compile(r"\bactx (submit|demo|status|rerun|verify|down|prepare|extract)\b"
                     r"([^`'\"\n;|&]*)")
# Flags of other tools that actx's messages and plans name, by tool.
BEAM = "Beam pipeline options (actx prepare passes them on)"
OTHER_TOOLS = {
    BEAM: {
        "runner", "setup_file", "direct_num_workers", "direct_running_mode", "region"},
    "Slurm (sbatch, srun)": {"array", "job-name", "kill-on-bad-exit", "nodes",
                             "ntasks-per-node", "output", "requeue", "no-requeue"},
    "gcloud": {"zone", "project"},
}


def _strings(path: str):
    """(line, text) of each string literal and f-string ("{}" for its fields) in a file."""
    tree = ast.parse(open(path).read())
    inner = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
             for v in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(
                v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in inner):
            yield node.lineno, node.value


def _sources(root: str = REPO):
    for top in ("deploy", "pipeline", "workers"):
        for directory, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                if name.endswith(".py"):
                    yield os.path.join(directory, name)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:
        found.update(o.lstrip("-") for o in action.option_strings)
    return found


def _command_parsers() -> dict[str, set[str]]:
    """{actx subcommand: its flags}; prepare and extract parse their own argv."""
    root = cli.build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {name: _options(p) for name, p in sub.choices.items()}
    # prepare hands the flags it does not know to Beam as pipeline options.
    parsers["prepare"] = _options(prepare_main._parser()) | OTHER_TOOLS[BEAM]
    parsers["extract"] = _options(workers_main.build_parser())
    return parsers


def _entry_point_flags() -> set[str]:
    """Flags every `add_argument("--x", ...)` in the package declares (the entry points
    `python -m actx....` build their parsers inside main())."""
    found = set()
    for path in _sources():
        for node in ast.walk(ast.parse(open(path).read())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"):
                found.update(a.value.lstrip("-") for a in node.args
                             if isinstance(a, ast.Constant) and isinstance(a.value, str)
                             and a.value.startswith("--"))
    return found


def _wrong_flags(root: str) -> list[str]:
    parsers = _command_parsers()
    known = set().union(*parsers.values(), _entry_point_flags(), *OTHER_TOOLS.values())
    wrong = []
    for path in _sources(root):
        where = os.path.relpath(path, root)
        for line, text in _strings(path):
            if " " not in text.strip():
                continue  # one word: an argument list's item, not a message
            for m in COMMAND.finditer(text):
                for flag in FLAG.findall(m.group(2)):
                    if flag not in parsers[m.group(1)]:
                        wrong.append(f"{where}:{line}: `actx {m.group(1)}` has no --{flag}")
            for flag in FLAG.findall(text):
                if flag not in known:
                    wrong.append(f"{where}:{line}: --{flag} is no flag of actx or of the "
                                 f"tools listed")
    return wrong


def test_every_flag_a_message_names_exists_on_its_command():
    wrong = _wrong_flags(REPO)
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_wrong_flag(tmp_path):
    """The scan itself: flags a command lacks, or nothing has, are found."""
    bad = tmp_path / "deploy" / "bad.py"
    bad.parent.mkdir()
    bad.write_text('A = f"not found; `actx submit {cfg} --tokenizer DIR`"\n'
                   'B = "point --no-such-flag at it"\n'
                   'C = ["--zone", "z"]\n')
    assert _wrong_flags(str(tmp_path)) == [
        "deploy/bad.py:1: `actx submit` has no --tokenizer",
        "deploy/bad.py:2: --no-such-flag is no flag of actx or of the tools listed"]

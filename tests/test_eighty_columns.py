"""Under COLUMNS=80 every line `actx submit` and `actx status` print fits in 80 columns, on a
terminal and into a pipe (issue 66, item 8): lines are wrapped between fields, never inside
one (a host, a path, a command), and a path under the current directory is written
relative to it, so that the commands printed with it work from there as printed. The
embedded demo on 2 local workers, from a directory whose absolute path alone is wider
than the terminal."""

from __future__ import annotations

import io
import re
import shlex
import shutil
import subprocess
import tempfile

import pytest

from actx.deploy import cli, columns

WIDTH = 80
ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
RUN = "runs/demo"  # the demo's run, under the current directory
READ = f"python -c \"import actx; print(actx.open_run('{RUN}').describe())\""


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _screen_lines(text: str) -> list[str]:
    """What a terminal shows line by line: a carriage return starts the line again (the
    progress line rewritten in place), escape sequences take no column."""
    return [ESCAPE.sub("", part) for line in text.split("\n") for part in line.split("\r")]


def _main(argv, out) -> str:
    assert cli.main(argv, out=out) == 0, out.getvalue()
    return out.getvalue()


@pytest.fixture
def project(tmp_path, monkeypatch, request, qwen_tokenizer_dir):
    """A working directory deeper than 80 columns; the demo's inputs in a cache with a
    path as short as ~/.cache/actx (the model's path is shown whole, outside the
    working directory)."""
    cache = tempfile.mkdtemp(prefix="actx-")
    request.addfinalizer(lambda: shutil.rmtree(cache, ignore_errors=True))
    shutil.copytree(qwen_tokenizer_dir, f"{cache}/qwen2-tokenizer")  # skip re-converting
    monkeypatch.setenv("ACTX_CACHE", cache)
    where = tmp_path / "a-project-directory-with-a-rather-long-name" / "experiments-2026-12-05"
    where.mkdir(parents=True)
    assert len(str(where / RUN)) > WIDTH
    monkeypatch.chdir(where)
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    return where


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "tty"])
def test_submit_and_status_fit_80_columns_wrapped_between_fields(project, monkeypatch, capsys,
                                                                  terminal):
    new = _Tty if terminal else io.StringIO
    said = {"submit": _main(["submit", "--job", "narrow"], new()),
            "status": _main(["status", RUN], new())}
    for command, text in said.items():
        lines = _screen_lines(text)
        wide = [line for line in lines if len(line) > WIDTH]
        assert not wide, f"{command}: lines over {WIDTH} columns:\n" + "\n".join(wide)
        for line in lines:  # a command in backticks is never cut in two
            assert line.count("`") % 2 == 0, f"{command}: a command split: {line!r}"
        assert str(project) not in text  # the directory's path: relative, as typed here
    # The fields that ran past 80 columns before, each whole on a line of its own.
    submit = _screen_lines(said["submit"])
    for field in (READ, f"actx verify {RUN}", f"activations in {RUN}/activations",
                  "local-r0h0", "local-r1h0", f"logs in {RUN}/logs/narrow"):
        assert any(field in line for line in submit), (field, said["submit"])
    # Status says everything it says without COLUMNS, only wrapped: the same words in the
    # same order (figures that tick between the two calls aside).
    monkeypatch.delenv("COLUMNS")
    whole = _main(["status", RUN], io.StringIO())
    assert max(len(line) for line in whole.splitlines()) > WIDTH  # it had to wrap
    assert _words(said["status"]) == _words(whole.replace(f"{project}/", ""))
    # An error of either command fits too (stderr).
    missing = str(project / "runs" / "not-there-yet")
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    assert cli.main(["status", missing], out=io.StringIO()) == 2
    said = capsys.readouterr().err
    assert "runs/not-there-yet: no such directory" in said
    assert max(len(line) for line in said.splitlines()) <= WIDTH, said
    # The commands, as printed with the relative path, work from here.
    verify = next(line for line in submit if line.startswith("check them:"))
    argv = shlex.split(verify.removeprefix("check them:"))
    assert argv == ["actx", "verify", RUN]
    assert cli.main(argv[1:], out=io.StringIO()) == 0
    done = subprocess.run(shlex.split(READ), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "layers.0.resid_post" in done.stdout, done.stderr[-2000:]


def _words(text: str) -> list[str]:
    return [re.sub(r"\d", "0", w) for w in ESCAPE.sub("", text).split()]


def test_fit_breaks_between_fields_and_keeps_quotes_and_commands_whole():
    """The rule itself, against lines written out by hand."""
    line = ("settings:   model /m/qwen; hooks layers.0.resid_post, layers.1.resid_post "
            "stored as bfloat16; seq_len 512, segmented packing, max_context 4,096")
    assert columns.fit(line, 62) == [
        "settings:   model /m/qwen; hooks layers.0.resid_post,",
        "            layers.1.resid_post stored as bfloat16;",
        "            seq_len 512, segmented packing, max_context 4,096"]
    # A command in backticks stays whole; an apostrophe inside a word opens no quote.
    line = "verify:     the run's data failed: `actx verify /r --repair` turns them pending"
    assert columns.fit(line, 50) == [
        "verify:     the run's data failed:",
        "            `actx verify /r --repair` turns them",
        "            pending"]
    # A command too wide for the label's indent goes two spaces in, whole.
    line = f"read them:   {READ}"
    assert columns.fit(line, 76) == ["read them:", f"  {READ}"]
    # A table's padding shrinks to two spaces before anything wraps.
    line = f"  {'local-r0h0':<28} {'done':<16} {'-':<30} {0:>10} tok/s  last beat 1s ago"
    assert columns.fit(line, 60) == ["  local-r0h0  done  -  0 tok/s  last beat 1s ago"]
    # A path under the current directory is written relative to it, only where needed.
    line = "check them:  actx verify /home/me/project/runs/mine"
    assert columns.fit(line, 80, cwd="/home/me/project") == [line]
    assert columns.fit(line, 40, cwd="/home/me/project") == [
        "check them:  actx verify runs/mine"]
    assert columns.fit(line, 40, cwd="/elsewhere") == [
        "check them:", "  actx verify /home/me/project/runs/mine"]
    assert columns.fit("x" * 100, None) == ["x" * 100]  # a pipe without COLUMNS: whole


def test_a_stop_and_a_failed_check_say_their_last_words_in_80_columns(tmp_path, monkeypatch,
                                                                     capsys):
    """What submit says when Ctrl-C stops it, and status --check's line after a verify
    that failed, are wrapped between fields as their other lines are (they were one line
    of 140-160 columns), each command whole."""
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    config = "/home/researcher/project/configs/my-own-data.yaml"
    assert cli._interrupted(["submit", config], KeyboardInterrupt()) == 130
    said = capsys.readouterr().err
    lines = said.splitlines()
    assert len(lines) > 1 and max(len(line) for line in lines) <= WIDTH, said
    assert all(line.count("`") % 2 == 0 for line in lines), said
    assert f"`actx submit {config}`" in said, said
    cli._say_error("actx status: 3 committed partition(s) failed the latest `actx verify`; "
                   "`actx verify runs/mine --repair` turns them back into pending, then "
                   "`actx rerun runs/mine` extracts them again")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) > 1 and max(len(line) for line in lines) <= WIDTH, lines
    monkeypatch.delenv("COLUMNS")  # a pipe without COLUMNS keeps whole lines, for grep
    cli._interrupted(["submit", config], KeyboardInterrupt())
    assert len(capsys.readouterr().err.splitlines()) == 1

"""Lines that fit the terminal's columns (`COLUMNS`, else the terminal's own width; a pipe
or a file without `COLUMNS` keeps whole lines, for grep): what submit, rerun and status
print is wrapped by field, never inside one (a path, a host, a command in backticks or
quotes), continuation lines indented under the first line's text; a path under the
current directory is written relative to it where the line would not fit otherwise (a
command printed with it works from here as printed)."""

from __future__ import annotations

import os
import re
import shutil

MIN_COLUMNS = 20
# Where a line may break: after these separators, outside quotes and backticks.
_BREAKS = re.compile(r"; | \| |, | {2,}")
_LABEL = re.compile(r"^(\s*(?:\[[^\]]*\] |[A-Za-z][\w -]{0,14}?: +)|\s+)")
_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_ABSOLUTE = re.compile(r"(?<![\w.~-])/[^\s'\"`;,()]+")
MAX_INDENT = 16


def columns(out) -> int | None:
    """How many characters a line of `out` may have: `COLUMNS` when set (tty or not),
    else a terminal's width; None for a pipe or a file without `COLUMNS`."""
    given = os.environ.get("COLUMNS", "").strip()
    if given.isdigit():
        return max(MIN_COLUMNS, int(given))
    if hasattr(out, "isatty") and out.isatty():
        return max(MIN_COLUMNS, shutil.get_terminal_size((80, 24)).columns)
    return None


def fit(line: str, width: int | None, cwd: str | None = None) -> list[str]:
    """`line` as lines of at most `width` characters (escape sequences not counted): a
    table's padding shrunk to two spaces, then broken after a field's separator ("; ",
    " | ", ", ", two spaces), the later lines indented under the text after the first
    line's label ("settings:   "). A field longer than a line breaks between its words,
    never inside a word, a quote or a command in backticks; a command (a field that starts
    with `actx` or `python`) never breaks, and goes two spaces in where the label's indent
    leaves it too little room; a word longer than a line stays whole."""
    if width is None or _visible(line) <= width:
        return [line]
    escapes = re.match(r"(?:\x1b\[[0-9;]*[A-Za-z])*", line).group(0)
    text = _relative_paths(line[len(escapes):], cwd or os.getcwd())
    label = _LABEL.match(text)
    head = label.group(0) if label else ""
    # A table's columns, kept apart by two spaces instead of their padding.
    text = head + re.sub(r"(?<=\S) {3,}", "  ", text[len(head):])
    if _visible(text) <= width:
        return [escapes + text]
    indent = " " * min(len(head) if head.strip() else len(head) + 2, MAX_INDENT)
    lines: list[str] = []
    current, filled = head, False

    def add(piece: str) -> None:
        nonlocal current, filled
        if filled and len(current) + len(piece.rstrip()) > width:
            lines.append(current.rstrip())
            current, filled = indent, False
        if not filled:
            piece = piece.lstrip()
            if len(current) + len(piece.rstrip()) > width and current == head != indent:
                lines.append(head.rstrip())  # the label alone: its field has a line
                current = indent
            if len(current) + len(piece.rstrip()) > width and current == indent:
                current = " " * min(2, len(indent))  # room for a long field
        current += piece
        filled = True

    for field in _split(text[len(head):], _BREAKS):
        if len(current) + len(field.rstrip()) <= width or not field.strip():
            current += field if filled else field.lstrip()
            filled = filled or bool(field.strip())
        elif re.match(r"\s*(actx|python) ", field) or " " not in field.strip():
            add(field)
        else:  # longer than the room left: on a line of its own, between its words
            if filled:
                lines.append(current.rstrip())
                current, filled = indent, False
            for word in _split(field.lstrip(), re.compile(" ")):
                add(word)
    if current.strip():
        lines.append(current.rstrip())
    lines[0] = escapes + lines[0]
    return lines


def _visible(line: str) -> int:
    return len(_ESCAPE.sub("", line))


def _relative_paths(line: str, cwd: str) -> str:
    """Absolute paths under `cwd` written relative to it (a path outside it stays)."""
    base = os.path.join(os.path.abspath(cwd), "")

    def shorter(m: re.Match) -> str:
        path = m.group(0)
        return os.path.relpath(path, base) if path.startswith(base) else path

    return _ABSOLUTE.sub(shorter, line)


def _split(text: str, at: re.Pattern) -> list[str]:
    """`text` cut after each match of `at` outside '...', "..." and `...`, each piece
    keeping its separator at its end."""
    pieces, start, quote, i = [], 0, None, 0
    while i < len(text):
        c = text[i]
        if quote:
            quote = None if c == quote else quote
        elif c == "`" or c == "[" or (c in "'\"" and (i == 0 or not text[i - 1].isalnum())):
            quote = "]" if c == "[" else c  # an apostrophe inside a word ("run's") opens nothing
        else:
            m = at.match(text, i)
            if m and m.end() > i:
                pieces.append(text[start:m.end()])
                start = i = m.end()
                continue
        i += 1
    if start < len(text):
        pieces.append(text[start:])
    return pieces


class FittedOut:
    """A text stream whose every whole line is written fitted to `width` (`fit`); what a
    terminal's progress line rewrites in place (text after a carriage return, cut to the
    terminal's width by its writer) goes through as it is."""

    def __init__(self, out, width: int):
        self._out, self.width = out, width
        self._pending = ""

    def write(self, text: str) -> int:
        *whole, rest = (self._pending + text).split("\n")
        for line in whole:
            if "\r" in line:
                self._out.write(line + "\n")
            else:
                self._out.write("\n".join(fit(line, self.width)) + "\n")
        if "\r" in rest:  # a line rewritten in place: shown now
            self._out.write(rest)
            rest = ""
        self._pending = rest
        return len(text)

    def flush(self) -> None:
        self._out.flush()

    def isatty(self) -> bool:
        return hasattr(self._out, "isatty") and self._out.isatty()

    def __getattr__(self, name: str):
        return getattr(self._out, name)

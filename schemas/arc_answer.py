"""The grid a model wrote in answer to an ARC prompt, and whether it is the task's answer.

The inverse of `pipeline.arc_render.encode_grid` for what a model generates after the
prompt `build_messages` makes: the answer is read in the prompt's own grid encoding, and
compared with the test output of the document's variant (`pipeline.arc_expected` finds
that grid and the encoder of a prepared document).

Which text counts (`parse_answer`):

1. The answer ends at the first end-of-turn text (`end_texts`, by default
   END_OF_TURN_TEXTS: the turn and EOS tokens of the supported chat templates, as text
   decoded with special tokens kept); whatever follows it is ignored. Text decoded
   without special tokens has none, and ends where the model stopped.
2. The text is cut into lines at "\\n"; each line is compared with surrounding
   whitespace (spaces, tabs, "\\r") removed.
3. A task with several test inputs is answered as `build_messages` writes its answer:
   "Test output N:" lines, each followed by its grid. Test `test_index` (0-based) is read
   from the lines after its header "Test output {test_index + 1}:" up to the next such
   header; without that header, test 0 is read from the lines before any header (a
   single-test answer has none), other tests have no answer.
4. Within those lines the grid is the FIRST maximal block of consecutive row lines,
   after any lead-in lines that are not rows (e.g. "Output:"). A row line is, per encoder:
     digits: only digits 0-9 ("0120");
     rows:   "<r>:" then the digits, optional spaces between ("3: 0120"); the block's
             labels must be 0, 1, 2, ... in order;
     shape:  a digit line as for digits, and the block must open with a header line
             "<H>x<W>" ("3x4") and hold exactly H rows of W cells.
   Only the first block is read: a later block is never tried in its place, so a model
   that writes several grids is judged on its first. A lead-in line that itself looks like
   a row (a lone "3" under digits) is read as the grid.
5. The block is a grid when its rows all have the same number of cells, with 1 to
   MAX_GRID_SIDE rows and cells per row (and, for rows / shape, the labels or header
   agree), and the line just before it and the line just after it are not malformed rows:
   lines that begin as a row does (a digit; under rows a label "<r>:") but are not rows
   (nor, under shape, a header): "3a5", "3 4 5", "1:". Otherwise, or when there is no
   block, there is no answer (None): ragged rows, no row at all, a cell that is not a
   digit, too large.

Pass the text the model generated after the prompt, not the stored assistant part of a
prepared document: that opens with the template text before the answer (ChatML: the user
turn's "<|im_end|>", which would end the answer before it starts).

A generation cut by max_new_tokens: pass `truncated=True` when the generator stopped for
length (workers.generate.generator's stop reason "length"), not at a stop token; an end-of-turn text
in the text overrides it (the turn ended). The last line may then be cut short and more
rows may have followed, so a grid counts only when a complete line that is not a row
follows it (a blank line, another "Test output" header): a grid that runs to the cut is
unreadable (None), even one that was complete when the cut came just before its
end-of-turn token. Without the flag the text is taken as the whole answer: a cut in the
middle of a row gives ragged rows (None), a cut just after a complete row reads the rows
before it as a smaller grid ("wrong", never "correct" for that task's output); but a model
that would have written more rows than the expected grid, cut just after writing all of
it, would read as "correct". The shape encoder's header catches such cuts (the row count
disagrees) whatever the flag says.
"""

from __future__ import annotations

import re
from typing import Sequence

MAX_GRID_SIDE = 30  # as pipeline.arc_render.MAX_GRID_SIDE: ARC grids are at most 30x30
ENCODERS = ("digits", "rows", "shape")  # as runspec.SourceSpec.arc_encoder

# The verdicts of `judge`.
CORRECT = "correct"
WRONG = "wrong"
UNPARSEABLE = "unparseable"
NO_EXPECTED = "no_expected"  # the task has no test output (a hidden evaluation answer)
VERDICTS = (CORRECT, WRONG, UNPARSEABLE, NO_EXPECTED)

# Where a model's turn ends, as text: ChatML (Qwen, SmolLM) and its EOS, Llama 3's turn
# and EOS, Gemma's turn and EOS, Phi-3's turn, Llama 2 / Mistral's EOS.
END_OF_TURN_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>",
                     "<end_of_turn>", "<eos>", "<|end|>", "</s>")

_DIGITS = re.compile(r"[0-9]+")
_LABELLED = re.compile(r"([0-9]+):[ \t]*([0-9]+)")
_SHAPE = re.compile(r"([0-9]+)x([0-9]+)")
_TEST_HEADER = re.compile(r"Test output ([0-9]+):")
_ROW_START = {"digits": re.compile(r"[0-9]"), "rows": re.compile(r"[0-9]+:"),
              "shape": re.compile(r"[0-9]")}

Grid = list[list[int]]


def _check_encoder(encoder: str) -> None:
    if encoder not in ENCODERS:
        raise ValueError(f"ARC encoder {encoder!r}: not one of {', '.join(ENCODERS)} "
                         f"(the source's arc_encoder in run.json)")


def _answer_lines(text: str, end_texts: Sequence[str], truncated: bool
                  ) -> tuple[list[str], bool]:
    """The answer's lines, stripped, and whether they end where the generation was cut
    (its unfinished last line already dropped)."""
    ends = [at for at in (text.find(t) for t in end_texts if t) if at >= 0]
    if ends:
        text, truncated = text[:min(ends)], False  # the turn ended: nothing was cut
    lines = text.split("\n")
    if truncated:
        lines.pop()  # unfinished: more of it (or another row) was still to come
    return [line.strip() for line in lines], truncated


def _test_section(lines: list[str], test_index: int) -> tuple[int, int] | None:
    """[start, stop) of the lines that answer test `test_index`, per rule 3."""
    headers = [(i, int(m.group(1))) for i, line in enumerate(lines)
               if (m := _TEST_HEADER.fullmatch(line))]
    for k, (i, number) in enumerate(headers):
        if number == test_index + 1:
            stop = next((j for j, _ in headers[k + 1:]), len(lines))
            return i + 1, stop
    if test_index == 0:
        return 0, headers[0][0] if headers else len(lines)
    return None


def _is_row(line: str, encoder: str) -> bool:
    if encoder == "rows":
        return _LABELLED.fullmatch(line) is not None
    return _DIGITS.fullmatch(line) is not None


def _is_malformed_row(line: str, encoder: str) -> bool:
    """Whether a line begins as a row but is not one (nor a shape header)."""
    return (_ROW_START[encoder].match(line) is not None and not _is_row(line, encoder)
            and not (encoder == "shape" and _SHAPE.fullmatch(line)))


def _first_block(lines: list[str], start: int, stop: int, encoder: str
                 ) -> tuple[str | None, list[str], int] | None:
    """(shape header or None, the block's row lines, index after the block), or None when
    the section holds no block, one without its header (shape), or one beside a malformed
    row."""
    for i in range(start, stop):
        header = encoder == "shape" and _SHAPE.fullmatch(lines[i]) is not None
        if not header and not _is_row(lines[i], encoder):
            continue  # a lead-in line
        if encoder == "shape" and not header:
            return None  # shape rows without their "HxW" header
        first = i + 1 if header else i
        end = first
        while end < stop and _is_row(lines[end], encoder):
            end += 1
        if any(_is_malformed_row(lines[k], encoder) for k in (i - 1, end) if start <= k < stop):
            return None
        return (lines[i] if header else None), lines[first:end], end
    return None


def _grid(header: str | None, rows: list[str], encoder: str) -> Grid | None:
    if encoder == "rows":
        labelled = [_LABELLED.fullmatch(row) for row in rows]
        if [int(m.group(1)) for m in labelled] != list(range(len(rows))):
            return None
        rows = [m.group(2) for m in labelled]
    if not rows or not 1 <= len(rows) <= MAX_GRID_SIDE:
        return None
    width = len(rows[0])
    if width > MAX_GRID_SIDE or any(len(row) != width for row in rows):
        return None
    if header is not None:
        height, header_width = map(int, _SHAPE.fullmatch(header).groups())
        if (height, header_width) != (len(rows), width):
            return None
    return [[int(c) for c in row] for row in rows]


def parse_answer(text: str, encoder: str, *, test_index: int = 0, truncated: bool = False,
                 end_texts: Sequence[str] = END_OF_TURN_TEXTS) -> Grid | None:
    """The grid the model wrote for test `test_index` in its generated `text`, read in
    `encoder` ("digits", "rows" or "shape", the source's arc_encoder), or None when no grid
    can be read. Which text counts: the module docstring. truncated: the generation
    stopped at max_new_tokens (not at a stop token); a grid that runs to the cut is then
    None. end_texts: where the model's turn ends, when decoded with special tokens."""
    _check_encoder(encoder)
    lines, cut = _answer_lines(text, end_texts, truncated)
    section = _test_section(lines, test_index)
    if section is None:
        return None
    found = _first_block(lines, *section, encoder)
    if found is None:
        return None
    header, rows, end = found
    if cut and end == len(lines):
        return None  # it reaches the cut: rows or cells may be missing
    return _grid(header, rows, encoder)


def _as_grid(expected) -> Grid:
    """`expected` as lists of ints (a numpy array or nested sequence), checked."""
    grid = [[int(v) for v in row] for row in expected]
    if not grid or not grid[0] or any(len(row) != len(grid[0]) for row in grid) or any(
            not 0 <= v <= 9 for row in grid for v in row):
        raise ValueError(f"expected ARC grid {expected!r}: not a non-empty rectangle of "
                         f"colours 0-9")
    return grid


def judge(text: str, expected, encoder: str, *, test_index: int = 0, truncated: bool = False,
          end_texts: Sequence[str] = END_OF_TURN_TEXTS) -> dict:
    """{"answer": the grid read by `parse_answer` (lists of ints) or None, "verdict":
    CORRECT / WRONG (a grid, not the expected one) / UNPARSEABLE (no grid) / NO_EXPECTED
    (`expected` is None: the task has no test output to compare with)}.

    expected: the test output of the document's variant (`pipeline.arc_expected`), None
    when unknown. The other arguments are parse_answer's."""
    answer = parse_answer(text, encoder, test_index=test_index, truncated=truncated,
                          end_texts=end_texts)
    if expected is None:
        verdict = NO_EXPECTED
    elif answer is None:
        verdict = UNPARSEABLE
    else:
        verdict = CORRECT if answer == _as_grid(expected) else WRONG
    return {"answer": answer, "verdict": verdict}


def judge_task(text: str, expected: Sequence, encoder: str, *,
               truncated: bool = False) -> dict:
    """Every test of a task, as a generating run records it: {"verdict", "tests": [judge
    of test j, ...]}. The task's verdict: CORRECT when every test is, NO_EXPECTED when a
    test has no output to compare with, UNPARSEABLE when an answer cannot be read, WRONG
    otherwise."""
    tests = [judge(text, grid, encoder, test_index=j, truncated=truncated)
             for j, grid in enumerate(expected)]
    verdicts = {t["verdict"] for t in tests}
    for verdict in (NO_EXPECTED, UNPARSEABLE, WRONG):
        if verdict in verdicts:
            break
    else:
        verdict = CORRECT if tests else NO_EXPECTED
    return {"verdict": verdict, "tests": tests}

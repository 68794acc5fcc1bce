"""ARC tasks to prompt text with per-character provenance, and their augmentations.

A prompt is built from attributed text pieces (prompt part, example index, grid kind, cell
row/column), so after tokenization every token can be traced to the grid cell it encodes.
Augmentations (8 dihedral transforms, colour permutations fixing 0) are deterministic
functions of (seed, task id, variant number).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

import numpy as np

from actx.schemas import layout

MAX_GRID_SIDE = 30
DIHEDRAL = ("identity", "rot90", "rot180", "rot270", "flip_lr", "flip_ud", "transpose",
            "anti_transpose")
SYSTEM_PROMPT = ("You solve abstract reasoning puzzles. Each grid is written as rows of "
                 "colour digits 0-9. Infer the rule from the examples and give the output "
                 "grid for the test input.")
PART = {name: i for i, name in enumerate(layout.ARC_PARTS)}
GRID = {name: i for i, name in enumerate(layout.ARC_GRIDS)}
# Per-character attribute rows of a rendered prompt (the per-token ARC arrays besides the
# task and variant, which are constant per document).
CHAR_ATTRS = ("arc_part", "arc_example", "arc_grid", "arc_row", "arc_col")


def validate_grid(grid) -> str | None:
    """None when `grid` is a valid ARC grid, else what is wrong with it."""
    if not isinstance(grid, list) or not grid:
        return "grid is not a non-empty list of rows"
    if not all(isinstance(row, list) for row in grid):
        return "grid rows are not lists"
    width = len(grid[0])
    if width == 0:
        return "grid has an empty row"
    for r, row in enumerate(grid):
        if len(row) != width:
            return f"ragged grid (row {r} has {len(row)} cells, row 0 has {width})"
    if len(grid) > MAX_GRID_SIDE or width > MAX_GRID_SIDE:
        return f"grid is {len(grid)}x{width}, larger than {MAX_GRID_SIDE}x{MAX_GRID_SIDE}"
    for r, row in enumerate(grid):
        for c, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, int):
                return f"cell ({r},{c}) is not an integer ({v!r})"
            if not 0 <= v <= 9:
                return f"cell ({r},{c}) = {v} is outside 0-9"
    return None


def validate_task(task) -> str | None:
    """None when `task` has valid train pairs and test inputs, else the first problem."""
    if not isinstance(task, dict):
        return f"task is a {type(task).__name__}, not an object"
    for split, need_output in (("train", True), ("test", False)):
        pairs = task.get(split)
        if not isinstance(pairs, list) or not pairs:
            return f"{split!r} is missing or not a non-empty list"
        for i, pair in enumerate(pairs):
            if not isinstance(pair, dict) or "input" not in pair:
                return f"{split}[{i}] has no input grid"
            if need_output and "output" not in pair:
                return f"{split}[{i}] has no output grid"
            for kind in ("input", "output"):
                if kind in pair:
                    problem = validate_grid(pair[kind])
                    if problem:
                        return f"{split}[{i}].{kind}: {problem}"
    return None


@dataclasses.dataclass(frozen=True)
class Variant:
    """An augmentation: variant number, dihedral transform and colour map (colours[c] = new c)."""

    index: int
    dihedral: str
    colours: tuple[int, ...]

    @property
    def description(self) -> str:
        if self.colours == tuple(range(10)):
            return self.dihedral
        return f"{self.dihedral};colours={''.join(map(str, self.colours))}"


def _colour_permutation(seed: int, task_id: str, dihedral: int, k: int) -> tuple[int, ...]:
    # Seeded from a stable hash (not Python's salted hash) so every worker agrees.
    digest = hashlib.sha256(f"{seed}:{task_id}:{dihedral}:{k}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "little"))
    rest = list(range(1, 10))
    rng.shuffle(rest)
    return (0, *rest)


def variants(task_id: str, dihedral: bool, colour_perms: int, seed: int) -> list[Variant]:
    """Variant 0 is the task itself; then colour permutations, per dihedral transform."""
    out = []
    for d, name in enumerate(DIHEDRAL if dihedral else DIHEDRAL[:1]):
        out.append(Variant(len(out), name, tuple(range(10))))
        for k in range(colour_perms):
            out.append(Variant(len(out), name, _colour_permutation(seed, task_id, d, k)))
    return out


def transform_grid(grid: list[list[int]], variant: Variant) -> list[list[int]]:
    a = np.asarray(grid, dtype=np.int64)
    a = {"identity": lambda x: x, "rot90": lambda x: np.rot90(x, 1),
         "rot180": lambda x: np.rot90(x, 2), "rot270": lambda x: np.rot90(x, 3),
         "flip_lr": np.fliplr, "flip_ud": np.flipud, "transpose": lambda x: x.T,
         "anti_transpose": lambda x: np.rot90(x, 2).T}[variant.dihedral](a)
    return np.asarray(variant.colours)[a].tolist()


def transform_task(task: dict, variant: Variant) -> dict:
    return {split: [{k: transform_grid(g, variant) for k, g in pair.items()}
                    for pair in task[split]] for split in ("train", "test")}


class AttributedText:
    """Text built from pieces, each with (part, example, grid, row, col) attributes."""

    def __init__(self):
        self.pieces: list[tuple[str, tuple[int, int, int, int, int]]] = []

    def add(self, text: str, part: int, example: int = -1, grid: int = -1, row: int = -1,
            col: int = -1) -> None:
        if text:
            self.pieces.append((text, (part, example, grid, row, col)))

    def extend(self, other: "AttributedText") -> None:
        self.pieces.extend(other.pieces)

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.pieces)

    def char_attrs(self) -> np.ndarray:
        """int32 [len(CHAR_ATTRS), n_chars]."""
        n = sum(len(t) for t, _ in self.pieces)
        out = np.full((len(CHAR_ATTRS), n), -1, dtype=np.int32)
        pos = 0
        for text, attrs in self.pieces:
            out[:, pos:pos + len(text)] = np.asarray(attrs, dtype=np.int32)[:, None]
            pos += len(text)
        return out


def encode_grid(out: AttributedText, grid: list[list[int]], encoder: str, part: int,
                example: int, kind: int) -> None:
    """Appends a grid: "digits" rows, "rows" ("<r>: " prefixes) or "shape" ("HxW" header)."""
    if encoder == "shape":
        out.add(f"{len(grid)}x{len(grid[0])}\n", part, example, kind)
    for r, row in enumerate(grid):
        if r:
            out.add("\n", part, example, kind)
        if encoder == "rows":
            out.add(f"{r}: ", part, example, kind)
        for c, v in enumerate(row):
            out.add(str(v), part, example, kind, r, c)


def build_messages(task: dict, encoder: str, include_test_output: bool
                   ) -> list[tuple[str, AttributedText]]:
    """(role, content) messages: system, user (train pairs, test inputs), assistant (answer)."""
    system = AttributedText()
    system.add(SYSTEM_PROMPT, PART["system"])
    user = AttributedText()
    u = PART["user"]
    for i, pair in enumerate(task["train"]):
        user.add(f"Example {i + 1}\nInput:\n", u, i)
        encode_grid(user, pair["input"], encoder, u, i, GRID["train_input"])
        user.add("\nOutput:\n", u, i)
        encode_grid(user, pair["output"], encoder, u, i, GRID["train_output"])
        user.add("\n\n", u, i)
    for j, pair in enumerate(task["test"]):
        user.add(f"Test input {j + 1}:\n", u, j)
        encode_grid(user, pair["input"], encoder, u, j, GRID["test_input"])
        if j + 1 < len(task["test"]):
            user.add("\n\n", u, j)
    messages = [("system", system), ("user", user)]
    if include_test_output and all("output" in p for p in task["test"]):
        answer = AttributedText()
        a = PART["assistant"]
        for j, pair in enumerate(task["test"]):
            if len(task["test"]) > 1:
                answer.add(f"Test output {j + 1}:\n", a, j)
            encode_grid(answer, pair["output"], encoder, a, j, GRID["test_output"])
            if j + 1 < len(task["test"]):
                answer.add("\n\n", a, j)
        messages.append(("assistant", answer))
    return messages


def _render_template(template: str, messages: list[dict], add_generation_prompt: bool,
                     template_vars: dict | None = None) -> str:
    """The template rendered as HF transformers' `apply_chat_template` renders it: its
    sandboxed environment, filters and globals, the special tokens by name (`bos_token`,
    ...) and the messages, with no tools or documents."""
    import datetime
    import json

    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' own filter: Jinja's escapes HTML characters.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    # As transformers: the clock of the machine that renders (Llama 3.2's date line).
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template).render(**{
        **(template_vars or {}), "messages": messages, "tools": None, "documents": None,
        "add_generation_prompt": add_generation_prompt})


def render_prompt(messages: list[tuple[str, AttributedText]], chat_template: str | None,
                  template_vars: dict | None = None) -> AttributedText:
    """The prompt as attributed text, through the chat template when there is one.

    template_vars: what the template sees besides the messages: the tokenizer's special
    tokens by name (pipeline.chat_templates.special_tokens), as transformers passes them.
    The template is rendered with a unique marker as each message's content, so the real
    (attributed) contents can be spliced in; template text before a message's content
    belongs to that message's part, text after the last content to the last message
    rendered, and the generation prompt (when there is no answer) to the assistant part.
    A system message the template leaves out (as transformers renders it) has no tokens;
    a user or assistant message left out, or rendered twice or changed, is an error
    (`check_template`, before any work).
    """
    out = AttributedText()
    if chat_template is None:
        for i, (role, content) in enumerate(messages):
            if i:
                out.add("\n\n", PART[role])
            out.extend(content)
        return out
    template_vars = template_vars or {}
    markers = [f"\x00ACTX-MSG-{i}\x00" for i in range(len(messages))]
    generate = messages[-1][0] != "assistant"
    plain = [{"role": r, "content": m} for (r, _), m in zip(messages, markers)]
    rendered = _render_template(chat_template, plain, False, template_vars)
    with_prompt = _render_template(chat_template, plain, generate, template_vars)
    if not with_prompt.startswith(rendered):
        raise ValueError("chat template: the generation prompt is not a suffix")
    # Where each message's content is in the rendered text. A template may leave a message
    # out (Mistral v0.3's puts the system message into the last user turn only, so none is
    # rendered when an assistant turn follows; transformers renders the same): the system
    # message's tokens are then simply absent, none attributed to it. The user turn (the
    # grids) and the answer must be there, each once and as given.
    spans = []
    for i, ((role, content), marker) in enumerate(zip(messages, markers)):
        at = rendered.find(marker)
        if at < 0:
            if f"actx-msg-{i}" in rendered.lower():
                raise ValueError(f"chat template: it changes the content of role {role!r} "
                                 f"(e.g. a filter on message['content']), so its tokens "
                                 f"cannot be traced to the grids")
            if role == "system":
                continue
            raise ValueError(f"chat template: message content of role {role!r} not rendered")
        if rendered.find(marker, at + 1) >= 0:
            raise ValueError(f"chat template: message content of role {role!r} rendered "
                             f"more than once")
        spans.append((at, role, content, marker))
    if not spans:
        raise ValueError("chat template: no message content rendered")
    spans.sort(key=lambda span: span[0])
    pos = 0
    for at, role, content, marker in spans:
        out.add(rendered[pos:at], PART[role])
        out.extend(content)
        pos = at + len(marker)
    out.add(rendered[pos:], PART[spans[-1][1]])
    out.add(with_prompt[len(rendered):], PART["assistant"])
    return out


def token_attrs(offsets: list[tuple[int, int]], char_attrs: np.ndarray) -> np.ndarray:
    """Per-token attributes int32 [len(CHAR_ATTRS), n_tokens] from character offsets.

    part/example/grid come from a token's first character; row/col only when the token
    covers exactly one grid cell (Qwen splits digits, so every cell is one token).
    """
    n_chars = char_attrs.shape[1]
    out = np.full((len(CHAR_ATTRS), len(offsets)), -1, dtype=np.int32)
    rows, cols = char_attrs[3], char_attrs[4]
    for t, (start, end) in enumerate(offsets):
        if n_chars == 0:
            break
        first = min(start, n_chars - 1)
        out[:3, t] = char_attrs[:3, first]
        cells = {(int(r), int(c)) for r, c in zip(rows[start:end], cols[start:end]) if r >= 0}
        if len(cells) == 1:
            out[3, t], out[4, t] = cells.pop()
    return out

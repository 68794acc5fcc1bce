"""What `actx verify --reference` recomputes of a generating run (spec.generate): a sample's
activations are of its prompt followed by what the model wrote, not of `tokens/input_ids`
(which hold the pad id in the room prepare reserved after each prompt).

The ids the model wrote are `generated.token_ids` (schemas.layout.GENERATED_IDS), stored
beside the hooks: GENERATED_PROMPT (-1) at prompt tokens, the id at each position the
sample reached, GENERATED_UNUSED (-2) at the room after it stopped, whose activations are
zeros. The text of a sample is the prompt with those ids after it; the reference runs on
that text up to the first position that is not known to be reached (unused, or in a
partition that is not committed yet, whose ids are not written), and every stored
position it reached is compared. The unused positions are checked to hold exactly zero.
A `generated.token_ids` that does not read as prompt, then reached, then unused is named
as damage.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from actx.schemas import layout


@dataclasses.dataclass(frozen=True)
class SampleText:
    """input_ids [n]: the sample's text (prompt, then the generated ids where reached; the
    stored pad ids past them). end: positions 0..end-1 are the text the reference runs
    on (the prompt and every reached position before the first unknown one). unused:
    bool [n], the committed positions the sample did not reach (their values must be 0).
    generated: how many positions of the text were generated. problems: what in
    generated.token_ids is not as a worker writes it (one line each)."""

    input_ids: np.ndarray
    end: int
    unused: np.ndarray
    generated: int
    problems: tuple[str, ...]


def generated_ids(run, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """generated.token_ids at the tokens (rows[i], cols[i]) (int64; no commit check: the
    caller keeps what committed partitions hold)."""
    array = run.open_array(layout.activation_array_key(layout.GENERATED_IDS))
    return np.asarray(array.vindex[rows, cols].read().result())[..., 0].astype(np.int64)


def sample_text(input_ids: np.ndarray, generated: np.ndarray, committed: np.ndarray,
                prompt_tokens: int) -> SampleText:
    """The text of one sample document, from its stored `input_ids` [n] and
    `generated` [n] (generated.token_ids) in document order; `committed` [n]: the positions
    in committed partitions (the others' generated ids are not written yet);
    `prompt_tokens`: where its prompt ends (the doc table's)."""
    n, p = len(input_ids), int(prompt_tokens)
    problems = []
    not_prompt = np.flatnonzero(committed[:p] & (generated[:p] != layout.GENERATED_PROMPT))
    if len(not_prompt):
        i = int(not_prompt[0])
        problems.append(f"{layout.GENERATED_IDS} holds {int(generated[i])} at prompt token {i} "
                        f"(of {p}), not {layout.GENERATED_PROMPT}")
    reached = committed & (generated >= 0)
    reached[:p] = False
    unused = committed & (generated == layout.GENERATED_UNUSED)
    unused[:p] = False
    odd = np.flatnonzero(committed[p:] & ~reached[p:] & ~unused[p:])
    if len(odd):
        i = p + int(odd[0])
        problems.append(f"{layout.GENERATED_IDS} holds {int(generated[i])} at token {i}, in "
                        f"the room after the prompt: neither an id nor "
                        f"{layout.GENERATED_UNUSED} (unused)")
    stops = np.flatnonzero(~reached[p:])
    end = p + (int(stops[0]) if len(stops) else n - p)
    # A sample stops once: no id after its first unused position.
    first_unused = np.flatnonzero(unused)
    if len(first_unused) and reached[first_unused[0]:].any():
        i = int(first_unused[0]) + int(np.flatnonzero(reached[first_unused[0]:])[0])
        problems.append(f"{layout.GENERATED_IDS} holds an id at token {i}, after token "
                        f"{int(first_unused[0])} that the sample did not reach")
    text = np.asarray(input_ids).copy()
    text[p:end] = generated[p:end]
    return SampleText(text, end, unused, end - p, tuple(problems))

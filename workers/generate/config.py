"""What a `workers.generate.generator.Generator` generates: the settings a run's `generate` section
carries (`GenerateConfig`), and the error that refuses a setting or prompt by its key
(`GenerateError`)."""

from __future__ import annotations

import dataclasses

from actx.schemas.errors import UserError


class GenerateError(UserError, ValueError):
    """A generate setting or prompt that cannot run; the message names the key."""


# generation_config.json settings HF `generate` applies besides what the generate section
# sets, which actx's generator does not, each with the value that turns it off (HF applies
# a checkpoint's own: Qwen2.5-Instruct's repetition_penalty 1.05 moves greedy answers).
# The sampling-only ones matter when the run samples.
UNAPPLIED = {"no_repeat_ngram_size": 0, "min_new_tokens": 0,
             "min_length": 0, "suppress_tokens": None, "begin_suppress_tokens": None,
             "bad_words_ids": None, "sequence_bias": None, "forced_bos_token_id": None,
             "forced_eos_token_id": None, "exponential_decay_length_penalty": None,
             "num_beams": 1, "penalty_alpha": None}
UNAPPLIED_SAMPLING = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                      "min_p": None}


def unapplied(generation_config: dict, greedy: bool, where: str,
              repetition_penalty: float = 1.0) -> list[str]:
    """What `where` (a checkpoint's generation_config.json) sets that HF `generate` would
    apply and actx does not: one line each, naming the setting and the HF call whose
    answers actx's are (empty: none). repetition_penalty: the run's (generate section),
    which actx applies; a checkpoint's other value is named with the key that takes it."""
    settings = dict(UNAPPLIED) if greedy else {**UNAPPLIED, **UNAPPLIED_SAMPLING}
    found = []
    theirs = generation_config.get("repetition_penalty")
    if isinstance(theirs, (int, float)) and theirs != repetition_penalty:
        found.append(f"{where} sets repetition_penalty={theirs!r}, which HF generate applies "
                     f"by default; this run's generate.repetition_penalty is "
                     f"{repetition_penalty!r}, so its answers are HF generate's with "
                     f"repetition_penalty={repetition_penalty!r} (set generate."
                     f"repetition_penalty: {theirs!r} for HF generate's default answers)")
    for key, off in settings.items():
        value = generation_config.get(key)
        if value is None or value == off or value == [] or value == {}:
            continue
        shown = "None" if off is None else repr(off)
        found.append(f"{where} sets {key}={value!r}, which actx's generator does not apply: "
                     f"its answers are HF generate's with {key}={shown}")
    return found


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """What to generate: the settings a run's `generate` section will carry.

    max_new_tokens: most tokens generated per sample (the stop token included).
    temperature: 0 for greedy (argmax); else sampling at this temperature.
    top_k: sample among the k likeliest tokens (0: all). top_p: nucleus sampling (1: off).
    stop_token_ids: a sample ends after generating any of these (kept in its tokens).
    samples_per_prompt: independent samples of each prompt.
    seed: the random streams' root (`workers.generate.sampling.token_key`).
    repetition_penalty: HF's (`workers.generate.sampling.penalise`; 1: off).
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    samples_per_prompt: int = 1
    seed: int = 0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self, vocab_size: int, max_positions: int = 0) -> None:
        """Refuses bad values, naming the key (`generate.<key>`)."""
        def bad(key, value, why):
            return GenerateError(f"generate.{key}={value!r}: {why}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", self.max_new_tokens, "must be an integer >= 1")
        if max_positions and self.max_new_tokens >= max_positions:
            raise bad("max_new_tokens", self.max_new_tokens,
                      f"leaves no room for a prompt within the model's "
                      f"max_position_embeddings={max_positions}; lower it")
        if not self.temperature >= 0:
            raise bad("temperature", self.temperature, "must be >= 0 (0: greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be an integer >= 0 (0: no limit)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1] (1: off)")
        if not isinstance(self.samples_per_prompt, int) or self.samples_per_prompt < 1:
            raise bad("samples_per_prompt", self.samples_per_prompt,
                      "must be an integer >= 1")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise bad("seed", self.seed, "must be an integer in [0, 2**32)")
        if not (isinstance(self.repetition_penalty, (int, float))
                and 0 < self.repetition_penalty < float("inf")):
            raise bad("repetition_penalty", self.repetition_penalty,
                      "must be a number > 0 (1: off; above 1 makes repeats less likely)")
        outside = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if outside:
            raise bad("stop_token_ids", list(self.stop_token_ids),
                      f"{outside} outside the model's vocabulary of {vocab_size} ids")

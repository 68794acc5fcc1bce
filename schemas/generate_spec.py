"""GenerateSpec: what a generating run asks of the model after each prompt (how many new
tokens, greedy or sampled, when a sample stops, how many samples, the seed).

Apart from `schemas.runspec` because it is the one section of a run's spec that only a
generating run has, with its own rules and its own doc (docs/generate.md); RunSpec holds
one as `generate` (None: a run that only reads its documents).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GenerateSpec:
    """Generation: the model writes after each document, which is its prompt, and the
    activations of what it writes are stored beside the prompt's (docs/generate.md).

    max_new_tokens: most tokens generated per sample, the stop token included. Prepare
      reserves this many positions after each prompt, so prompt + max_new_tokens must fit
      packing.max_context (a longer prompt is rejected with its reason).
    temperature: 0 for greedy decoding (argmax, as HF `generate` without sampling); above
      0, sampling at this temperature.
    top_k: sample among the k likeliest tokens (0: no limit).
    top_p: nucleus sampling over the smallest set of tokens whose probability reaches top_p
      (1: off).
    stop_token_ids: a sample ends after writing one of these ids (kept in its tokens).
      Unset: the model's eos_token_id (generation_config.json, then config.json), the
      tokenizer's EOS and its chat template's end-of-turn token.
    samples_per_prompt: independent samples of each prompt; each is its own document in
      the token store (its `sample` in the doc table).
    seed: the root of the random streams. A token's stream depends only on the seed, its
      prompt's document, its sample and its index, never on slot, batch or host.
    repetition_penalty: HF's repetition penalty (1: off): the logit of each id the sample
      holds so far (prompt and generated) is divided by it where positive, multiplied
      where negative, before sampling or the argmax. A checkpoint's generation_config.json
      value is not taken by itself (the pre-flight names it); absent from run.json while 1.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] | None = None
    samples_per_prompt: int = 1
    seed: int = 0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        def bad(key, why):
            return ValueError(f"{key}: {why}")

        if self.max_new_tokens < 1:
            raise bad("max_new_tokens", f"must be at least 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise bad("temperature", f"must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise bad("top_k", f"must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1] (1: off), got {self.top_p}")
        if self.samples_per_prompt < 1:
            raise bad("samples_per_prompt", f"must be at least 1, got {self.samples_per_prompt}")
        if not 0 <= self.seed < 2**32:
            raise bad("seed", f"must be in [0, 2**32), got {self.seed}")
        if not (isinstance(self.repetition_penalty, (int, float))
                and 0 < self.repetition_penalty < float("inf")):
            raise bad("repetition_penalty", f"must be a number > 0 (1: off), got "
                                            f"{self.repetition_penalty!r}")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"token ids are >= 0, got {list(self.stop_token_ids)}")

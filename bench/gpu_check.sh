#!/usr/bin/env bash
# The GPU-machine figures of bench/RESULTS.md in one run on a lent GPU machine (device
# `run`), one output file per step under $OUT. Steps, in order of priority (a step that
# would start past the budget is skipped, and each has its own cap):
#   extract_memory        extract writing to /dev/shm: the host side without the disk,
#                         for each place the step's outputs can land (issue 27: written to
#                         pinned host by the step, left in device memory and copied, or
#                         copied into pinned host after the step), interleaved in one run;
#                         beside HF's pinned-buffer extraction and the minimal JAX script
#                         (bench/minimal_jax.py) on the same model, in the same process
#   read_none, read_zstd  reader (issue 14) on this host's cores: the streaming shuffle
#                         against the sequential decoded read, hidden 896, 0.94 GB stores
#   read_jax              the same stream handing over device-ready JAX arrays on the GPU
#   cached_attention      one layer's attention over a row and its cached context, each
#                         way actx has (bench/cached_attention.py): time, error, slot bytes
#   gpu_tests             the long-document HF parity tests and the cached-attention tests
#                         on the GPU (float32 at full matmul precision)
#   decode_tests          the generating steps' Pallas kernel (workers/attention/decode_flash.py)
#                         against the XLA attention and a Generator on it against HF, on
#                         the GPU (float32 at full matmul precision)
#   generate              generation with 4 hooks captured (bench/generate.py), Qwen2.5-0.5B
#                         shapes, 64 prompts x 256 new tokens, the XLA attention and the
#                         Pallas kernel in turn, vs HF generate(output_hidden_states=True)
#   long_documents        exact context through the per-slot KV cache vs rows computed
#                         alone vs truncate (issue 9), Qwen2.5-0.5B shapes, seq 1024;
#                         exact also with the fused cuDNN call (the way before the kernel)
#   forward               actx forward-only and 4 resid_post hooks vs HF PyTorch on CUDA
#                         (plain forward, and 4 layers copied into pinned host buffers)
#                         and vs the minimal JAX script, checked against actx's hooks
#   forward_8b            the same for Llama-3.1-8B layer shapes (8 of its 32 layers)
#   extract               end to end through Worker.run (token store -> committed bf16
#                         shards on local disk), overflow continue and truncate, vs
#                         forward-only of the same steps (target >= 0.95), host ms per step
#   write_bandwidth       this host's local disk: GB/s of 64 MB writes, fsync'd
#   extract_all_layers    extract with all 24 layers hooked (target >= 0.9 x the lower of
#                         forward only and the write bandwidth)
# The GPU image has JAX (CUDA), tensorstore, transformers and torch but not crc32c: carry
# its wheel (bench/RESULTS.md, "Getting GPU figures").
#
# STEPS="read_jax forward" runs only those steps (default: all, in the order above).
# SMALL=1 runs every step at toy sizes: a dry run of this script on any machine (CPU),
# to catch a broken step before spending device time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/actx-gpu-check}"
BUDGET_S="${BUDGET_S:-540}"  # the whole script; leave room under the call's timeout
SMALL="${SMALL:-0}"
STEPS=" ${STEPS:-kernel_probe tile_sweep extract_memory decode_tests generate read_none read_zstd read_jax cached_attention gpu_tests long_documents forward forward_8b extract write_bandwidth extract_all_layers} "
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$SECONDS

# step NAME CAP_S COMMAND...: COMMAND's output (absl's I/W lines dropped) to $OUT/NAME.txt,
# killed after CAP_S seconds or what is left of BUDGET_S, whichever is less.
step() {
  local name=$1 cap=$2
  shift 2
  [[ $STEPS == *" $name "* ]] || return 0
  local left=$((BUDGET_S - (SECONDS - start)))
  ((left < cap)) && cap=$left
  if ((cap < 20)); then
    echo "== $name: skipped, the budget is spent" | tee "$OUT/$name.txt"
    return
  fi
  echo "== $name (at most ${cap} s): $*" | tee "$OUT/$name.txt"
  local t0=$SECONDS
  timeout --kill-after=5 "$cap" "$@" 2>&1 | grep -v '^[IW][0-9]\{4\} ' | tee -a "$OUT/$name.txt"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$OUT/$name.txt"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  nproc
  python3 -c "import jax, numpy, tensorstore, torch, transformers; print('jax', jax.__version__, jax.devices()); print('numpy', numpy.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1
} | tee "$OUT/gpu.txt"

if [[ $SMALL == 1 ]]; then
  READ=(--rows 64 --passes 1 --rounds 1)
  CACHED=(--batch 2 --seq 128 --blocks 2 --heads 4 --kv-heads 2 --head-dim 32 --iters 2)
  MODEL=(--hidden 128 --heads 4 --kv-heads 2 --intermediate 256 --layers 2 --vocab 512)
  LONG=("${MODEL[@]}" --seq 128 --batch 4 --docs 12 --median 100 --max-context 512
        --partition-rows 16 --hooked-layers 1)
  FWD=("${MODEL[@]}" --seq 64 --batch 2 --iters 2 --minimal-jax)
  FWD8=(--arch llama3 --head-dim 32 "${MODEL[@]}" --seq 64 --batch 2 --iters 2)
  EXTRACT=("${MODEL[@]}" --seq 64 --batch 2 --partitions 1 --steps-per-partition 2 --skip-hf
           --hooked-layers 2 --rounds 1)
  EXTRACT_ALL=("${EXTRACT[@]}" --hooked-layers 2 --packing truncate)
  PROBE=(--seq 64 --head-dim 32 --heads 4 --kv-heads 2 --blocks 2)
  SWEEP=("${CACHED[@]}" --iters 1)
  EXTRACT_MEM=("${MODEL[@]}" --seq 64 --batch 2 --partitions 1 --steps-per-partition 2
               --hooked-layers 2 --rounds 1 --output-memory auto,device,pinned_copy
               --minimal-jax)
  GENERATE=(--hidden 64 --layers 2 --heads 4 --kv-heads 2 --intermediate 128 --vocab 512
            --batch 4 --prompts 8 --prompt-len 16 --new-tokens 8 --iters 1 --attention xla,pallas)
  WRITE_GB=1
else
  READ=(--rows 512 --passes 3 --rounds 2)
  CACHED=()
  LONG=(--qwen05b --seq 1024 --docs 480 --partition-rows 256 --also cudnn)
  FWD=(--qwen05b --iters 10 --minimal-jax)
  FWD8=(--llama8b --layers 8 --iters 5)
  EXTRACT=(--qwen05b --skip-hf --codec none --rounds 1)
  EXTRACT_ALL=(--qwen05b --skip-hf --codec none --rounds 1 --hooked-layers 24
               --partitions 2 --steps-per-partition 4 --packing truncate)
  PROBE=()
  SWEEP=()
  EXTRACT_MEM=(--qwen05b --codec none --rounds 1 --partitions 4 --steps-per-partition 8
               --output-memory auto,device,pinned_copy --minimal-jax)
  GENERATE=(--qwen05b --prompts 64 --new-tokens 256 --iters 2 --attention xla,pallas)
  WRITE_GB=8
fi

step kernel_probe 60 python3 bench/kernel_probe.py "${PROBE[@]}"
step tile_sweep 100 python3 bench/cached_attention.py --sweep-tiles "${SWEEP[@]}"
TILES=$(grep -s '^best: ' "$OUT/tile_sweep.txt" | cut -d' ' -f2)
if [[ -n $TILES ]]; then
  CACHED+=(--flash-tiles "$TILES") LONG+=(--flash-tiles "$TILES") FWD+=(--flash-tiles "$TILES")
  EXTRACT+=(--flash-tiles "$TILES") EXTRACT_ALL+=(--flash-tiles "$TILES")
  EXTRACT_MEM+=(--flash-tiles "$TILES")
fi
mkdir -p /dev/shm/actx-extract && df -h /dev/shm >> "$OUT/gpu.txt"
step extract_memory 240 python3 bench/extract.py "${EXTRACT_MEM[@]}" --dir /dev/shm/actx-extract
rm -rf /dev/shm/actx-extract
step decode_tests 90 env JAX_PLATFORMS= JAX_DEFAULT_MATMUL_PRECISION=highest \
  python3 -m pytest -q -p no:cacheprovider --noconftest tests/test_decode_flash.py
step generate 200 env XLA_PYTHON_CLIENT_PREALLOCATE=false SMALL= python3 bench/generate.py \
  "${GENERATE[@]}"
step read_none 100 python3 bench/read.py --codec none "${READ[@]}" --also-decoded
step read_zstd 100 python3 bench/read.py --codec zstd "${READ[@]}"
step read_jax 60 python3 bench/read.py --codec none "${READ[@]}" --rounds 1 --framework jax
step cached_attention 90 python3 bench/cached_attention.py "${CACHED[@]}"
# tests/conftest.py pins JAX to the CPU and loads the Beam fixtures: not here.
step gpu_tests 150 env JAX_PLATFORMS= JAX_DEFAULT_MATMUL_PRECISION=highest \
  python3 -m pytest -q -p no:cacheprovider --noconftest tests/test_long_documents.py \
  tests/test_cached_attention.py
step long_documents 180 python3 bench/long_documents.py "${LONG[@]}"
# JAX takes 75% of the GPU's memory up front by default; HF's torch runs in the same process.
step forward 120 env XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/forward.py "${FWD[@]}"
step forward_8b 90 env XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/forward.py "${FWD8[@]}"
step extract 180 python3 bench/extract.py "${EXTRACT[@]}"
step write_bandwidth 60 python3 -c "
import os, tempfile, time, numpy as np
block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
with tempfile.TemporaryDirectory() as d:
    path, n = os.path.join(d, 'w'), $WRITE_GB * 16
    t0 = time.perf_counter()
    with open(path, 'wb') as f:
        for _ in range(n):
            f.write(block)
        f.flush(); os.fsync(f.fileno())
    s = time.perf_counter() - t0
    print(f'local write: {n * 64 / 1024:.1f} GB in {s:.2f} s = {n * 64 / 1024 / s:.2f} GB/s (fsync at the end)')
"
step extract_all_layers 150 python3 bench/extract.py "${EXTRACT_ALL[@]}"
echo "== all steps done in $((SECONDS - start)) s" | tee -a "$OUT/gpu.txt"

#!/usr/bin/env bash
# On a CUDA machine, in one call: how the verifier's vLLM engine does on this GPU, the most telling part first.
# Each part writes its results into OUT_DIR as they come, so a call cut short keeps what it measured:
#   1. OUT_DIR/async_parity: do greedy sessions give the same tokens on the engine stepping synchronously and
#      asynchronously, on this GPU? A tiny random target in fp32, else bf16 (bench/studies/vllm_async_parity.py); the
#      asynchronous figures of part 2 mean something only where it says yes;
#   2. OUT_DIR/parity: target-only streams on MODEL_DIR against vLLM alone (tools/gpu_parity.sh with
#      VLLM_SYNC=1): the verifier as it starts by default (cloud_only) and each of VARIANTS beside it;
#   3. OUT_DIR/capacity: sessions per GPU on CAPACITY_MODEL (tools/gpu_capacity.sh, the tokenizer from
#      MODEL_DIR), served by the verifier that streamed the most tokens at the middle stream count of part 2,
#      of those part 1 allows (OUT_DIR/capacity.flags says which).
#
#   tools/gpu_measure.sh MODEL_DIR OUT_DIR
#
# Environment (defaults): VARIANTS ("sync - --no-vllm-async-scheduling;full - --vllm-cudagraph-mode FULL":
# tools/gpu_parity.sh's format), PARITY_SHARE and PARITY_KV_BYTES (0.15 and
# 6000000000: each of part 2's servers' GPU share and KV), CAPACITY_MODEL (bench/data/configs/qwen2.5-coder-7b),
# PARTS (1 2 3), PYTHON (python3), EAGER=1 (no compiled graphs: a dry run on a CPU). The parts' own variables
# (STREAMS, REPEATS, STEP_S, RESOLUTION, ...) pass through to them.
set -euo pipefail
model=$1 out=$2
py=${PYTHON:-python3}
parts=${PARTS:-1 2 3}
here=$(dirname "$0")
variants=${VARIANTS-sync - --no-vllm-async-scheduling;full - --vllm-cudagraph-mode FULL}
mkdir -p "$out"
say() { echo "$(date +%T) gpu_measure: $*"; }
eager=()
[ -z "${EAGER:-}" ] || eager=(--enforce-eager)

if [[ " $parts " == *" 1 "* ]]; then
    say "part 1: synchronous against asynchronous steps, a tiny target"
    $py -c "import sys; from pathlib import Path; from bench.tiny_models import save_pair; save_pair(Path(sys.argv[1]), vllm=True)" "$out/tiny"
    study=$out/async_parity/vllm_async_parity.json
    for dtype in float32 bfloat16; do  # bf16 where fp32 does not run (an attention backend without it)
        rm -f "$study"
        $py -m bench.studies.vllm_async_parity --target "$out/tiny/target" --dtype "$dtype" "${eager[@]}" \
            --out "$out/async_parity" && break
        if grep -q '"asynchronous_against_synchronous"' "$study" 2>/dev/null; then
            say "part 1: the two schedulings differ in $dtype: see $out/async_parity"; break
        fi
        say "part 1: the study did not run in $dtype"
    done
fi
if [[ " $parts " == *" 2 "* ]]; then
    say "part 2: streams against vLLM alone"
    VLLM_SYNC=1 VARIANTS="$variants" GPU_SHARE=${PARITY_SHARE:-0.15} KV_BYTES=${PARITY_KV_BYTES:-6000000000} \
        bash "$here/gpu_parity.sh" "$model" "$out/parity" || say "part 2 failed: see $out/parity"
fi
if [[ " $parts " == *" 3 "* ]]; then
    flags=$($py -m bench.fastest_verifier --parity "$out/parity/stream_parity/stream_parity.json" \
        --async-parity "$out/async_parity/vllm_async_parity.json" --variants "$variants") || flags=
    echo "$flags" > "$out/capacity.flags"
    say "part 3: sessions per GPU on ${CAPACITY_MODEL:-bench/data/configs/qwen2.5-coder-7b}, verifier flags: ${flags:-none}"
    TOKENIZER_DIR=$model VERIFIER_FLAGS="${VERIFIER_FLAGS:-} $flags" \
        bash "$here/gpu_capacity.sh" "${CAPACITY_MODEL:-bench/data/configs/qwen2.5-coder-7b}" "$out/capacity"
fi
say "done"

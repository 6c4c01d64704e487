#!/usr/bin/env bash
# On a CUDA machine: the verifier's figures with the target's real shapes, in bf16.
#   1. per-round batched pass time: packed against slot KV, 1/4/8/16 sessions x 1k/4k context
#      (bench.studies.kv_layout_timing, the transformers engine); with --engine vllm instead, one
#      pass by new tokens and by sessions on vLLM (argmax and full rows, and its own decoding)
#      beside the transformers engine on the same GPU (bench.studies.engine_pass_timing), and
#      whether greedy speculative equals cloud_only in bf16 with and without vLLM's
#      batch-invariant kernels (bench.studies.vllm_batch_invariance);
#   2. the capacity search (python -m bench.loadtest --find-capacity), speculative against cloud_only, with the
#      verifier on the GPU (on --engine) and the recorded sessions replayed from the machine's CPU cores.
# The model is CONFIG_DIR's architecture with random weights (bench/random_weights.py) and the
# shipped Qwen traces are rewritten for it round for round (bench/retarget_traces.py), so each
# round accepts what the recorded pair accepted.
#
#   tools/gpu_capacity.sh [--engine transformers|vllm] CONFIG_DIR OUT_DIR [SLO_ITL_P95_MS] [MAX_SESSIONS] [STEP_S]
#
# A step whose result is already in OUT_DIR is not run again, so a run cut short goes on where
# it stopped. --engine vllm runs the verifier and its studies under ENGINE_PYTHON (default
# .venv-vllm/bin/python, the venv tools/vllm_env.sh builds: on a CUDA box it installs vllm
# itself); TP=N splits the target over N GPUs (--tensor-parallel-size), GPU_MEMORY=0.85 is
# vLLM's share of each GPU; SLO_TPOT=MS adds a target on the time per output token; SKIP_STUDIES=1
# goes straight to the capacity search.
set -euo pipefail
engine=transformers
if [ "${1:-}" = --engine ]; then engine=$2; shift 2; fi
config_dir=$1 out=$2 slo=${3:-2500} max_sessions=${4:-256} step_s=${5:-15}
py=${PYTHON:-python3}
vpy=${ENGINE_PYTHON:-.venv-vllm/bin/python}  # not VLLM_*: vLLM warns of VLLM_ variables it does not know
port=${PORT:-50071} http_port=${HTTP_PORT:-8091}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv"

if [ ! -d "$out/model" ]; then
    $py -m bench.random_weights --config-dir "$config_dir" --out "$out/model.part" --device cuda --dtype bfloat16
    mv "$out/model.part" "$out/model"
fi
if [ "$engine" = vllm ] && [ -z "${SKIP_STUDIES:-}" ]; then
    [ -f "$out/pass_timing/engine_pass_timing.json" ] ||
        $vpy -m bench.studies.engine_pass_timing --target "$out/model" --engines vllm,transformers --device cuda \
            --dtypes bfloat16 --context 1024 --sessions 1,4,16 --repeats 10 --out "$out/pass_timing"
    [ -f "$out/batch_invariance/report.md" ] ||
        $vpy -m bench.studies.vllm_batch_invariance --target "$out/model" --draft-device cuda --dtype bfloat16 \
            --prompts bench/data/spec_bench_3short.jsonl --max-new-tokens 64 --verifier-flags=--enforce-eager \
            --out "$out/batch_invariance"
elif [ "$engine" != vllm ]; then
    [ -f "$out/kv_layout.json" ] ||
        $py -m bench.studies.kv_layout_timing --model "$out/model" --device cuda --dtype bfloat16 --sessions 1,4,8,16 \
            --contexts 1024,4096 --rounds 10 --output "$out/kv_layout.json"
fi
if [ ! -d "$out/traces" ]; then
    $py -m bench.retarget_traces --traces bench/data/traces/qwen --model "$out/model" --out "$out/traces.part" \
        --device cuda --dtype bfloat16
    mv "$out/traces.part" "$out/traces"
fi

if [ "$engine" = vllm ]; then
    $vpy -m cloud --engine vllm --model "$out/model" --dtype bfloat16 --port "$port" --http-port "$http_port" \
        --tensor-parallel-size "${TP:-1}" --gpu-memory-utilization "${GPU_MEMORY:-0.85}" --max-context-tokens 8192 \
        --max-sessions 2048 --max-batch-size 64 --max-queue 4096 > "$out/verifier.log" 2>&1 &
else
    $py -m cloud --model "$out/model" --device cuda --dtype bfloat16 --port "$port" --http-port "$http_port" \
        --max-sessions 2048 --max-batch-size 64 --max-queue 4096 > "$out/verifier.log" 2>&1 &
fi
verifier=$!
trap 'kill $verifier 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do  # vLLM compiles its graphs first: minutes
    $py -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$http_port/readyz')" 2>/dev/null && break
    sleep 1
done
$py -m bench.loadtest --cloud "127.0.0.1:$port" --trace "$out/traces" --find-capacity --slo-itl-p95-ms "$slo" \
    --capacity-max-sessions "$max_sessions" --capacity-step-s "$step_s" --no-progress ${SLO_TPOT:+--slo-tpot-p95-ms "$SLO_TPOT"} \
    --metrics-url "http://127.0.0.1:$http_port/metrics" --report "$out/capacity" --output "$out/capacity/capacity.json"

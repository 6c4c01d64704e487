#!/usr/bin/env bash
# On a CUDA machine: sessions per GPU within the reader's target (TPOT p95 <= 50 ms, TTFT p95 <= 1 s) for
# vLLM's own OpenAI-compatible server alone, and for speculative, auto and cloud_only sessions through
# cloud-verifier --engine vllm: the same recorded sessions, on the same GPU, in one run.
#
#   tools/gpu_capacity.sh [--engine vllm|transformers] MODEL_DIR OUT_DIR
#
# MODEL_DIR holds a model's config.json and tokenizer files (or TOKENIZER_DIR does: e.g. MODEL_DIR
# bench/data/configs/qwen2.5-coder-7b, TOKENIZER_DIR a Qwen2.5 folder); no weights: both engines start with
# load_format=dummy (vLLM's random weights in the model's shapes: a pass costs what the real model's costs).
# --engine transformers serves the verifier with transformers instead; it needs weights, so random ones are
# written into OUT_DIR/model first (bench/random_weights.py) and vLLM's server reads the same folder.
# The two servers start together, each with GPU_SHARE of the GPU and KV_BYTES of KV (so that neither's memory
# profile sees the other's), and are measured one at a time. The sessions (TRACES, default the laptop traces
# in bench/data/traces/laptop) are rewritten for the served model through the verifier's own greedy
# decoding (bench/retarget_traces.py --cloud), round for round, so each round accepts what the recorded
# pair accepted. The edge's think-time is scaled by THINK_SCALE (see bench/data/README.md: the drafting
# speed it stands for). auto sessions decode until the verifier, holding more than PREFER_ABOVE sessions,
# asks them to speculate (cloud-verifier --prefer-speculation-above).
#
# Each capacity level is appended to RESULTS/capacity.levels.jsonl as it ends and a run started again
# takes the levels found there (the traces in OUT_DIR too), so a run cut short goes on where it stopped.
# RESULTS (default OUT_DIR) gets capacity.json, .levels.jsonl, .md and .png, unscaled.json and .levels.jsonl
# (one speculative session with the recorded think-time unscaled, after the table), and when it is another
# folder, the last lines of both servers' logs: eight small files.
#
# Environment (defaults): SYSTEMS (vllm_alone,speculative,auto,cloud_only), THINK_SCALE (0.35), SLO_TPOT and
# SLO_TTFT (the load tester's defaults, 50 and 1000 ms),
# MAX_SESSIONS (128), STEP_S (4), RESOLUTION (0.1: the search stops within 10%), MAX_OUTPUT_TOKENS (none),
# GPU_SHARE (0.45), KV_BYTES (18000000000), MAX_CONTEXT (4096), PREFER_ABOVE (16), TP (1), LOAD_PROCESSES (1:
# the load generator's processes; its CPU per level is in the report), VERIFIER_FLAGS (more cloud-verifier flags,
# e.g. --no-vllm-engine-process),
# PYTHON (python3), READY_TIMEOUT_S (400), PORT/HTTP_PORT/VLLM_PORT (50071/8091/8092), EAGER=1 (both engines
# without compiled graphs: a start in seconds, slower steps; for a dry run on a CPU).
set -euo pipefail
engine=vllm
if [ "${1:-}" = --engine ]; then engine=$2; shift 2; fi
model=$1 out=$2
py=${PYTHON:-python3}
traces=${TRACES:-bench/data/traces/laptop}
port=${PORT:-50071} http_port=${HTTP_PORT:-8091} vllm_port=${VLLM_PORT:-8092}
share=${GPU_SHARE:-0.45} kv=${KV_BYTES:-18000000000} context=${MAX_CONTEXT:-4096}
mkdir -p "$out"
if [ -n "${TOKENIZER_DIR:-}" ]; then  # the configuration from one folder, the tokenizer from another
    mkdir -p "$out/model-config"
    cp "$model/config.json" "$out/model-config/"
    for f in generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
        [ ! -f "$TOKENIZER_DIR/$f" ] || cp "$TOKENIZER_DIR/$f" "$out/model-config/"
    done
    model=$out/model-config
fi
say() { echo "$(date +%T) gpu_capacity: $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1 || true

load=dummy
eager=()
[ -z "${EAGER:-}" ] || eager=(--enforce-eager)
read -r -a extra <<< "${VERIFIER_FLAGS:-}"
engine_flags=(--engine vllm --load-format dummy --tensor-parallel-size "${TP:-1}" --gpu-memory-utilization "$share"
    --max-kv-bytes "$kv" "${eager[@]}" "${extra[@]}")
if [ "$engine" = transformers ]; then
    if [ ! -d "$out/model" ]; then
        $py -m bench.random_weights --config-dir "$model" --out "$out/model.part" --device cuda --dtype bfloat16
        mv "$out/model.part" "$out/model"
    fi
    model=$out/model load=auto engine_flags=(--device cuda "${extra[@]}")
fi

results=${RESULTS:-$out}
mkdir -p "$results"
source "$(dirname "$0")/gpu_servers.sh"
finish() {
    stop_servers
    if [ "$results" != "$out" ]; then
        for f in verifier.log vllm.log; do [ ! -f "$out/$f" ] || tail -n 300 "$out/$f" > "$results/$f"; done
    fi
}
trap finish EXIT
trap 'exit 143' TERM INT  # a run stopped from outside still leaves its logs in RESULTS
start_servers
wait_servers || exit 1
systems=${SYSTEMS:-vllm_alone,speculative,auto,cloud_only}
if [ $vllm_up = 0 ]; then
    say "measuring without vLLM's own server"
    systems=$(echo "$systems" | tr ',' '\n' | grep -v '^vllm_alone$' | paste -sd, -)
fi

if [ ! -d "$out/traces" ]; then
    say "rewriting $traces for the served model"
    $py -m bench.retarget_traces --traces "$traces" --cloud "127.0.0.1:$port" --out "$out/traces.part"
    mv "$out/traces.part" "$out/traces"
fi
say "capacity search: $systems"
$py -m bench.loadtest --cloud "127.0.0.1:$port" --trace "$out/traces" --find-capacity --systems "$systems" \
    --vllm-url "http://127.0.0.1:$vllm_port" --think-scale "${THINK_SCALE:-0.35}" \
    ${SLO_TPOT:+--slo-tpot-p95-ms "$SLO_TPOT"} ${SLO_TTFT:+--slo-ttft-p95-ms "$SLO_TTFT"} \
    --capacity-max-sessions "${MAX_SESSIONS:-128}" --capacity-step-s "${STEP_S:-4}" \
    --capacity-resolution "${RESOLUTION:-0.1}" ${MAX_OUTPUT_TOKENS:+--max-output-tokens "$MAX_OUTPUT_TOKENS"} \
    --metrics-url "http://127.0.0.1:$http_port/metrics" --no-progress --resume --load-processes "${LOAD_PROCESSES:-1}" \
    --output "$results/capacity.json" --report "$results"
say "one speculative session with the recorded think-time as it was (unscaled)"
$py -m bench.loadtest --cloud "127.0.0.1:$port" --trace "$out/traces" --find-capacity --systems speculative --think-scale 1 \
    ${SLO_TPOT:+--slo-tpot-p95-ms "$SLO_TPOT"} ${SLO_TTFT:+--slo-ttft-p95-ms "$SLO_TTFT"} \
    --capacity-max-sessions 1 --capacity-step-s "${STEP_S:-4}" ${MAX_OUTPUT_TOKENS:+--max-output-tokens "$MAX_OUTPUT_TOKENS"} \
    --metrics-url "http://127.0.0.1:$http_port/metrics" --no-progress --resume --output "$results/unscaled.json"

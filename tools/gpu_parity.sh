#!/usr/bin/env bash
# On a CUDA machine: the verifier's vLLM engine against vLLM alone, in one run on one GPU.
#   1. target-only streams: N concurrent Generate streams through cloud-verifier --engine vllm (cloud_only) against
#      the same streams on vLLM's own OpenAI-compatible server, at each N of STREAMS (bench/studies/stream_parity.py);
#   2. with STEP_OVERHEAD=1, the two servers stopped, a vLLM step of STREAMS requests with nothing served: a plain
#      vLLM engine against the verifier's live sessions (bench/studies/vllm_step_overhead.py);
#   3. then a k = 4 round on the verifier's live sessions against a decode step, at each session count of
#      ROUND_SESSIONS (bench/studies/vllm_live_rounds.py).
#
#   tools/gpu_parity.sh MODEL_DIR OUT_DIR
#
# MODEL_DIR holds a model's config.json and tokenizer files; both engines start with load_format=dummy (vLLM's random
# weights in the model's shapes: a step costs what the real model's costs). OUT_DIR gets stream_parity/,
# step_overhead/ and live_rounds/ (each a JSON result and report.md, written level by level) and the servers' logs.
#
# Environment (defaults): STREAMS (1,24,64), PROMPT_TOKENS (200), NEW_TOKENS (256), TEMPERATURE and TOP_P (0 and
# 1: greedy; 0.7 and 0.95 sample every stream as chat traffic does), REPEATS (3), ROUND_SESSIONS
# (1,16; empty: no rounds), GPU_SHARE (0.4), KV_BYTES (16000000000), MAX_CONTEXT (4096), VERIFIER_FLAGS (more
# cloud-verifier flags), VARIANTS (none: more verifiers beside the first, measured side by side in the same run,
# each "LABEL SWITCH_S [FLAGS...]", separated by ';': SWITCH_S is Python's thread switch interval in its process,
# '-' for the default; FLAGS are more cloud-verifier flags), STRETCHES=1 (each verifier also streams the tokens as
# Decode stretches, as auto-mode edges do), STEP_OVERHEAD=1 (step 2), BANNED (step 2's live sessions ban that
# many padding rows, as a draft's narrower vocabulary does; their step is also measured with vLLM's own mask),
# VLLM_SYNC=1 (a second vLLM server, "vllm_sync", run as the verifier runs vLLM: without async scheduling and
# with the V1 model runner, which vLLM chooses for the proposer that carries the edge's drafts; what is left
# between it and the verifier is the verifier's own), PYTHON (python3), READY_TIMEOUT_S (400),
# PORT/HTTP_PORT/VLLM_PORT/VLLM_SYNC_PORT (50071/8091/8092/8190; the variants take the next odd ports), EAGER=1
# (the engines without compiled graphs: for a dry run on a CPU).
set -euo pipefail
model=$1 out=$2
py=${PYTHON:-python3}
port=${PORT:-50071} http_port=${HTTP_PORT:-8091} vllm_port=${VLLM_PORT:-8092} vllm_sync_port=${VLLM_SYNC_PORT:-8190}
share=${GPU_SHARE:-0.4} kv=${KV_BYTES:-16000000000} context=${MAX_CONTEXT:-4096}
mkdir -p "$out"
say() { echo "$(date +%T) gpu_parity: $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1 || true

load=dummy
eager=()
[ -z "${EAGER:-}" ] || eager=(--enforce-eager)
read -r -a extra <<< "${VERIFIER_FLAGS:-}"
engine_flags=(--engine vllm --load-format dummy --tensor-parallel-size "${TP:-1}" --gpu-memory-utilization "$share"
    --max-kv-bytes "$kv" "${eager[@]}" "${extra[@]}")
vocab=$($py -c "import json, sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$model/config.json")

source "$(dirname "$0")/gpu_servers.sh"
trap stop_servers EXIT
trap 'exit 143' TERM INT
start_servers
clouds="cloud_only=127.0.0.1:$port" metrics="http://127.0.0.1:$http_port/metrics"
IFS=';' read -r -a variants <<< "${VARIANTS:-}"
for i in "${!variants[@]}"; do
    read -r label switch flags <<< "${variants[i]}"
    read -r -a flags <<< "${flags:-}"
    grpc=$((port + 2 * (i + 1))) http=$((http_port + 2 * (i + 1)))
    start_verifier "$out/verifier-$label.log" "$grpc" "$http" "$switch" "${flags[@]}"
    clouds+=",$label=127.0.0.1:$grpc" metrics+=",http://127.0.0.1:$http/metrics"
done
wait_servers || exit 1
[ "$vllm_up" = 1 ] || exit 1
peers="vllm_alone=http://127.0.0.1:$vllm_port"
[ "$vllm_sync_up" = 1 ] && peers+=",vllm_sync=http://127.0.0.1:$vllm_sync_port"
say "streams: ${STREAMS:-1,24,64} on $clouds against $peers"
$py -m bench.studies.stream_parity --cloud "$clouds" --metrics "$metrics" --vllm-url "$peers" \
    --streams "${STREAMS:-1,24,64}" --prompt-tokens "${PROMPT_TOKENS:-200}" --new-tokens "${NEW_TOKENS:-256}" \
    --repeats "${REPEATS:-3}" --vocab "$vocab" --temperature "${TEMPERATURE:-0}" --top-p "${TOP_P:-1}" \
    --out "$out/stream_parity" ${STRETCHES:+--stretches}
stop_servers
if [ -n "${STEP_OVERHEAD:-}" ]; then
    say "a step with nothing served: a plain vLLM engine against the verifier's live sessions"
    $py -m bench.studies.vllm_step_overhead --target "$model" --load-format dummy --streams "${STREAMS:-1,24,64}" \
        --gpu-memory 0.4 --max-sessions 2048 --max-context "$context" ${BANNED:+--banned "$BANNED"} "${eager[@]}" \
        --out "$out/step_overhead"
fi
if [ -n "${ROUND_SESSIONS-1,16}" ]; then
    say "a round against a decode step: ${ROUND_SESSIONS-1,16} sessions"
    $py -m bench.studies.vllm_live_rounds --target "$model" --load-format dummy --sessions "${ROUND_SESSIONS-1,16}" --k 4 \
        --temperature "${TEMPERATURE:-0}" --top-p "${TOP_P:-1}" --gpu-memory 0.5 --out "$out/live_rounds"
fi
say "done"

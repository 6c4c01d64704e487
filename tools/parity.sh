#!/usr/bin/env bash
# The verifier's vLLM engine against vLLM alone, in one report, one server at a time (two servers up at once
# take each other's cores on a small machine):
#   1. target-only streams: N concurrent Generate streams through cloud-verifier --engine vllm (cloud_only)
#      against the same streams on vLLM's own OpenAI-compatible server, at each N of STREAMS, greedy and at
#      temperature 0.7, top-p 0.95 (bench/studies/stream_parity.py); the servers take turns ALTERNATIONS times;
#   2. a served k = 4 round over loopback gRPC against the engine's own round, at each of ROUND_SESSIONS
#      (bench/studies/served_rounds.py), while the verifier is up;
#   3. a vLLM step with nothing served: a plain vLLM engine against the verifier's live sessions
#      (bench/studies/vllm_step_overhead.py);
#   4. a k = 4 round on the live sessions against a decode step, in process (bench/studies/vllm_live_rounds.py);
# then OUT_DIR/report.md and parity.json (bench/studies/parity_report.py), the machine named.
#
#   tools/parity.sh MODEL_DIR OUT_DIR
#
# `make parity-cpu` runs it on a CPU with the GPU-short model (tools/proxy_model.py) and EAGER=1. With a real model
# folder, LOAD=auto and no EAGER, it is the GPU run.
#
# Environment (defaults): STREAMS (1,8,32,64), PROMPT_TOKENS (200), NEW_TOKENS (128), REPEATS (3: runs of a level
# each time a server is up), ALTERNATIONS (2), SAMPLED (1: also at T = 0.7, top-p 0.95; empty: greedy only),
# ROUND_SESSIONS (1,16), STEPS (300: step 3's steps), LOAD (dummy), EAGER (empty: compiled graphs), KV_BYTES
# (2000000000), MAX_CONTEXT (2048), GPU_SHARE (0.4), VERIFIER_FLAGS (more cloud-verifier flags), PYTHON
# (python3), PORT/HTTP_PORT/VLLM_PORT (50071/8091/8092), READY_TIMEOUT_S (400), PARTS (1 2 3 4), THREADS (on a
# CPU, the verifier's --threads: as vLLM's own server binds its model, every core but the one it leaves its
# frontend, so that both compute on the same cores; empty on a GPU).
set -euo pipefail
model=$1 out=$2
py=${PYTHON:-python3}
port=${PORT:-50071} http_port=${HTTP_PORT:-8091} vllm_port=${VLLM_PORT:-8092}
share=${GPU_SHARE:-0.4} kv=${KV_BYTES:-2000000000} context=${MAX_CONTEXT:-2048} load=${LOAD:-dummy}
streams=${STREAMS:-1,8,32,64} parts=${PARTS:-1 2 3 4}
mkdir -p "$out"
say() { echo "$(date +%T) parity: $*"; }
eager=()
[ -z "${EAGER:-}" ] || eager=(--enforce-eager)
read -r -a extra <<< "${VERIFIER_FLAGS:-}"
cores=$(nproc)
threads=${THREADS-$(command -v nvidia-smi > /dev/null || echo $((cores > 1 ? cores - 1 : 1)))}
[ -z "$threads" ] || extra=(--threads "$threads" "${extra[@]}")
engine_flags=(--engine vllm --load-format "$load" --tensor-parallel-size "${TP:-1}" --gpu-memory-utilization "$share"
    --max-kv-bytes "$kv" "${eager[@]}" "${extra[@]}")
vocab=$($py -c "import json, sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$model/config.json")
samplings=("0 1")
[ -z "${SAMPLED-1}" ] || samplings+=("0.7 0.95")

source "$(dirname "$0")/gpu_servers.sh"
trap stop_servers EXIT
trap 'exit 143' TERM INT

up() {  # URL LOG: wait until the server answers, or fail with its log's end
    for _ in $(seq 1 "${READY_TIMEOUT_S:-400}"); do
        _ready "$1" && return 0
        sleep 1
    done
    say "no answer from $1:"; tail -n 30 "$2"; return 1
}

streams() {  # SYSTEM ALTERNATION FLAGS...: stream_parity on one server, at each sampling
    local system=$1 round=$2 sampling t p
    shift 2
    for sampling in "${samplings[@]}"; do
        read -r t p <<< "$sampling"
        $py -m bench.studies.stream_parity "$@" --streams "$streams" --prompt-tokens "${PROMPT_TOKENS:-200}" \
            --new-tokens "${NEW_TOKENS:-128}" --repeats "${REPEATS:-3}" --vocab "$vocab" --temperature "$t" --top-p "$p" \
            --out "$out/streams/$system-t$t-$round"
    done
}

if [[ " $parts " == *" 1 "* || " $parts " == *" 2 "* ]]; then
    for round in $(seq 1 "${ALTERNATIONS:-2}"); do
        if [[ " $parts " == *" 1 "* ]]; then
            say "streams on vLLM alone ($round)"
            _start_vllm "$vllm_port" "$out/vllm.log"
            up "http://127.0.0.1:$vllm_port/v1/models" "$out/vllm.log"
            streams vllm_alone "$round" --vllm-url "http://127.0.0.1:$vllm_port"
            stop_servers
        fi
        say "the verifier ($round)"
        start_verifier "$out/verifier.log" "$port" "$http_port" -
        up "http://127.0.0.1:$http_port/readyz" "$out/verifier.log"
        [[ " $parts " != *" 1 "* ]] || streams cloud_only "$round" --cloud "127.0.0.1:$port" --metrics "http://127.0.0.1:$http_port/metrics"
        if [[ " $parts " == *" 2 "* ]] && [ "$round" = 1 ] && [ -n "${ROUND_SESSIONS-1,16}" ]; then
            say "served rounds at ${ROUND_SESSIONS-1,16} sessions"
            $py -m bench.studies.served_rounds --cloud "127.0.0.1:$port" --sessions "${ROUND_SESSIONS-1,16}" --k 4 \
                --context "${PROMPT_TOKENS:-200}" --vocab "$vocab" --out "$out/served_rounds"
        fi
        stop_servers
    done
fi
if [[ " $parts " == *" 3 "* ]]; then
    say "a step with nothing served"
    $py -m bench.studies.vllm_step_overhead --target "$model" --load-format "$load" --streams "${STEP_STREAMS:-1,8,32}" \
        --steps "${STEPS:-300}" --gpu-memory "$share" --kv-bytes "$kv" --max-sessions 2048 --max-context "$context" \
        "${eager[@]}" --out "$out/step_overhead"
fi
if [[ " $parts " == *" 4 "* ]] && [ -n "${ROUND_SESSIONS-1,16}" ]; then
    say "a round on the live sessions against a decode step"
    $py -m bench.studies.vllm_live_rounds --target "$model" --load-format "$load" --sessions "${ROUND_SESSIONS-1,16}" \
        --k 4 --context "${PROMPT_TOKENS:-200}" --gpu-memory "$share" "${eager[@]}" --out "$out/live_rounds"
fi
$py -m bench.studies.parity_report "$out"
say "done: $out/report.md"

# Sourced by tools/gpu_capacity.sh and tools/gpu_parity.sh: cloud-verifier and vLLM's own OpenAI-compatible
# server on the same model, started together, each with GPU_SHARE of the GPU and KV_BYTES of KV (so that neither's
# memory profile sees the other's).
#
# start_servers: needs py, model, out, port, http_port, vllm_port, share, kv, context, load (the weights vLLM's
# server reads: dummy or auto), engine_flags (the verifier's engine flags), eager (an array, maybe empty) and
# say(); logs go to $out/verifier.log and $out/vllm.log, the pids to pids. With VLLM_SYNC=1 and vllm_sync_port
# set, a second vLLM server runs as the verifier's vLLM does (no async scheduling, the V1 model runner; its log
# $out/vllm_sync.log; vllm_sync_up says whether it answered). start_verifier LOG PORT HTTP_PORT
# SWITCH_S [FLAGS...]: one more verifier (SWITCH_S: Python's thread switch interval in its process, sys.
# setswitchinterval; "-": Python's default). wait_servers: waits until every verifier and vLLM's server answer
# (READY_TIMEOUT_S, default 400); fails when a verifier does not; sets vllm_up (0: vLLM's server did not start).
# stop_servers: ends them all.

pids=()
verifier_http=() verifier_log=() verifier_pid=()
start_verifier() {
    local log=$1 grpc=$2 http=$3 switch=$4
    shift 4
    local run=(-m cloud)
    [ "$switch" = - ] || run=(-c "import runpy, sys; sys.setswitchinterval($switch); sys.argv[0] = 'cloud'; runpy.run_module('cloud', run_name='__main__', alter_sys=True)")
    $py "${run[@]}" "${engine_flags[@]}" --model "$model" --dtype bfloat16 --port "$grpc" --http-port "$http" \
        --max-context-tokens "$context" --max-sessions 2048 --max-batch-size 256 --max-queue 8192 \
        --prefer-speculation-above "${PREFER_ABOVE:-16}" "$@" > "$log" 2>&1 &
    pids+=($!)
    verifier_http+=("$http") verifier_log+=("$log") verifier_pid+=($!)
}

start_servers() {
    say "starting cloud-verifier (${engine_flags[*]:0:2}) and vLLM's own server on $model ($load weights)"
    start_verifier "$out/verifier.log" "$port" "$http_port" -
    _start_vllm "$vllm_port" "$out/vllm.log"
    vllm_pid=$!
    # vLLM alone run as the verifier's engine is: no async scheduling, the V1 model runner.
    if [ -n "${VLLM_SYNC:-}" ] && [ -n "${vllm_sync_port:-}" ]; then
        VLLM_USE_V2_MODEL_RUNNER=0 _start_vllm "$vllm_sync_port" "$out/vllm_sync.log" --no-async-scheduling
        vllm_sync_pid=$!
    fi
}

_start_vllm() {  # PORT LOG [FLAGS...]: vLLM's own server, in the background (its pid in $!)
    local at=$1 log=$2
    shift 2
    $py -m vllm.entrypoints.openai.api_server --model "$model" --load-format "$load" --dtype bfloat16 --port "$at" \
        --host 127.0.0.1 --tensor-parallel-size "${TP:-1}" --gpu-memory-utilization "$share" --kv-cache-memory-bytes "$kv" \
        --max-model-len "$((context + 1))" --max-num-seqs 512 --served-model-name target "${eager[@]}" "$@" > "$log" 2>&1 &
    pids+=($!)
}

_ready() { $py -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; }

wait_servers() {
    local up=() i _ all
    vllm_up=0 vllm_sync_up=0
    for _ in $(seq 1 "${READY_TIMEOUT_S:-400}"); do  # vLLM compiles its graphs first: minutes
        all=1
        for i in "${!verifier_http[@]}"; do
            [ "${up[i]:-0}" = 1 ] && continue
            if _ready "http://127.0.0.1:${verifier_http[i]}/readyz"; then up[i]=1; say "verifier :${verifier_http[i]} ready"; else all=0; fi
        done
        [ $vllm_up = 1 ] || ! _ready "http://127.0.0.1:$vllm_port/v1/models" || { vllm_up=1; say "vLLM server ready"; }
        [ -z "${vllm_sync_pid:-}" ] || [ $vllm_sync_up = 1 ] || ! _ready "http://127.0.0.1:$vllm_sync_port/v1/models" ||
            { vllm_sync_up=1; say "vLLM server without async scheduling ready"; }
        if [ -n "${vllm_sync_pid:-}" ] && [ $vllm_sync_up = 0 ] && ! kill -0 "$vllm_sync_pid" 2>/dev/null; then
            say "vLLM's server without async scheduling exited:"; tail -n 30 "$out/vllm_sync.log"; vllm_sync_pid=
        fi
        [ $all = 1 ] && [ $vllm_up = 1 ] && { [ -z "${vllm_sync_pid:-}" ] || [ $vllm_sync_up = 1 ]; } && break
        for i in "${!verifier_http[@]}"; do
            kill -0 "${verifier_pid[i]}" 2>/dev/null || [ "${up[i]:-0}" = 1 ] || { say "a verifier exited:"; tail -n 30 "${verifier_log[i]}"; return 1; }
        done
        kill -0 "$vllm_pid" 2>/dev/null || [ $vllm_up = 1 ] || { [ $all = 1 ] && break; }
        sleep 1
    done
    for i in "${!verifier_http[@]}"; do
        [ "${up[i]:-0}" = 1 ] || { say "the verifier on :${verifier_http[i]} did not become ready"; tail -n 30 "${verifier_log[i]}"; return 1; }
    done
    [ $vllm_up = 1 ] || { say "vLLM's own server did not start"; tail -n 30 "$out/vllm.log"; }
}

stop_servers() {
    local p
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    pids=() verifier_http=() verifier_log=() verifier_pid=()
}

# Sourced by tools/gpu_capacity.sh and tools/gpu_parity.sh: cloud-verifier and vLLM's own OpenAI-compatible
# server on the same model, started together, each with GPU_SHARE of the GPU and KV_BYTES of KV (so that neither's
# memory profile sees the other's).
#
# start_servers: needs py, model, out, port, http_port, vllm_port, share, kv, context, load (the weights vLLM's
# server reads: dummy or auto), engine_flags (the verifier's engine flags), eager (an array, maybe empty) and
# say(); logs go to $out/verifier.log and $out/vllm.log, the pids to pids. wait_servers: waits until both answer
# (READY_TIMEOUT_S, default 400); fails when the verifier does not; sets vllm_up (0: vLLM's server did not start).
# stop_servers: ends both.

pids=()
start_servers() {
    say "starting cloud-verifier (${engine_flags[*]:0:2}) and vLLM's own server on $model ($load weights)"
    $py -m cloud "${engine_flags[@]}" --model "$model" --dtype bfloat16 --port "$port" --http-port "$http_port" \
        --max-context-tokens "$context" --max-sessions 2048 --max-batch-size 256 --max-queue 8192 \
        --prefer-speculation-above "${PREFER_ABOVE:-16}" > "$out/verifier.log" 2>&1 &
    pids+=($!)
    $py -m vllm.entrypoints.openai.api_server --model "$model" --load-format "$load" --dtype bfloat16 --port "$vllm_port" \
        --host 127.0.0.1 --tensor-parallel-size "${TP:-1}" --gpu-memory-utilization "$share" --kv-cache-memory-bytes "$kv" \
        --max-model-len "$((context + 1))" --max-num-seqs 512 --served-model-name target "${eager[@]}" > "$out/vllm.log" 2>&1 &
    pids+=($!)
}

_ready() { $py -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; }

wait_servers() {
    local verifier_up=0 _
    vllm_up=0
    for _ in $(seq 1 "${READY_TIMEOUT_S:-400}"); do  # vLLM compiles its graphs first: minutes
        [ $verifier_up = 1 ] || ! _ready "http://127.0.0.1:$http_port/readyz" || { verifier_up=1; say "verifier ready"; }
        [ $vllm_up = 1 ] || ! _ready "http://127.0.0.1:$vllm_port/v1/models" || { vllm_up=1; say "vLLM server ready"; }
        [ $verifier_up = 1 ] && [ $vllm_up = 1 ] && break
        kill -0 "${pids[0]}" 2>/dev/null || [ $verifier_up = 1 ] || { say "the verifier exited:"; tail -n 30 "$out/verifier.log"; return 1; }
        kill -0 "${pids[1]}" 2>/dev/null || [ $vllm_up = 1 ] || break
        sleep 1
    done
    [ $verifier_up = 1 ] || { say "the verifier did not become ready"; tail -n 30 "$out/verifier.log"; return 1; }
    [ $vllm_up = 1 ] || { say "vLLM's own server did not start"; tail -n 30 "$out/vllm.log"; }
}

stop_servers() {
    local p
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    pids=()
}

#!/usr/bin/env bash
# The load sweep: the shipped Qwen traces replayed with N sessions arriving at once, against
# a verifier with cross-session batching and one without (--max-batch-size 1), speculative and
# cloud_only, one verifier process per configuration; then one table (python -m tools.load_table).
#   tools/load_sweep.sh OUT_DIR [DTYPE] [SESSIONS] [PROMPT_CAP] [OUTPUT_CAP] [THINK_SCALE]
# THINK_SCALE 0 (default) sends each round as soon as the last reply arrives: the verifier's
# capacity, with no edge drafting time between rounds.
set -euo pipefail
out=${1:?usage: tools/load_sweep.sh OUT_DIR [DTYPE] [SESSIONS] [PROMPT_CAP] [OUTPUT_CAP]}
dtype=${2:-bfloat16}
sessions=${3:-1 4 8 16}
prompt_cap=${4:-48}  # "none": the recorded prompts as they are (their drafts stay valid)
output_cap=${5:-32}
think_scale=${6:-0}
py=${PY:-.venv/bin/python}
mkdir -p "$out"

run_config() {  # name, verifier flags, loadtest mode
    local name=$1 flags=$2 mode=$3 log="$out/$1.verifier.log"
    $py -m cloud --port 0 --http-port 0 --dtype "$dtype" $flags >"$log" 2>&1 &
    local pid=$!
    until grep -q "serving .* on" "$log"; do
        kill -0 $pid 2>/dev/null || { echo "verifier failed: $log" >&2; exit 1; }
        sleep 1
    done
    local address http
    address=$(grep -o "serving .* on [0-9.]*:[0-9]*" "$log" | grep -o "[0-9.]*:[0-9]*$")
    http=$(grep -o "http on [0-9.]*:[0-9]*" "$log" | grep -o "[0-9.]*:[0-9]*$")
    for n in $sessions; do
        # --scale 0.001: every session arrives at once; copies of the ten traces, cut to n sessions.
        local caps=(--max-output-tokens "$output_cap")
        [ "$prompt_cap" = none ] || caps+=(--max-prompt-tokens "$prompt_cap")
        $py -m bench.loadtest --cloud "$address" --mode "$mode" --scale 0.001 --think-scale "$think_scale" --sessions $(( (n + 9) / 10 )) \
            --max-sessions "$n" "${caps[@]}" \
            --metrics-url "http://$http/metrics" --no-progress --output "$out/$name.n$n.json"
        echo "$name n=$n done" >&2
    done
    kill $pid; wait $pid || true
}

run_config spec_batched "" speculative
[ -n "${SKIP_UNBATCHED:-}" ] || run_config spec_unbatched "--max-batch-size 1" speculative
run_config cloud_only_batched "" cloud_only
$py -m tools.load_table --out "$out"

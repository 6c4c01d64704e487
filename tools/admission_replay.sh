#!/usr/bin/env bash
# The overload replay: 24 recorded Qwen sessions arriving at once (8 copies of the traces, cut to 24),
# against cloud-verifier --dtype bfloat16 and --dtype auto, speculative and cloud_only.
set -u
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${1:-results/admission}
mkdir -p $OUT
for dtype in bfloat16 auto; do
  log=$OUT/verifier.$dtype.log
  $PY -m cloud --port 0 --http-port 0 --dtype $dtype >"$log" 2>&1 &
  pid=$!
  until grep -q "serving .* on" "$log"; do sleep 1; kill -0 $pid || exit 1; done
  address=$(grep -o "serving .* on [0-9.]*:[0-9]*" "$log" | grep -o "[0-9.]*:[0-9]*$")
  http=$(grep -o "http on [0-9.]*:[0-9]*" "$log" | grep -o "[0-9.]*:[0-9]*$")
  for mode in speculative cloud_only; do
    echo "== $dtype $mode $(date +%T)"
    $PY -m bench.loadtest --cloud "$address" --mode $mode --sessions 8 --max-sessions 24 \
        --metrics-url "http://$http/metrics" --no-progress --output $OUT/$dtype.$mode.json --report $OUT/$dtype.$mode 2>&1 | tail -2
  done
  kill $pid; wait $pid
done
echo ALLDONE

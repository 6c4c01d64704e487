#!/usr/bin/env bash
# Run auto, speculative, cloud_only and edge_only on the same prompts against one cloud-verifier,
# side by side in one run, then summarise.
#   tools/compare_modes.sh OUTDIR PROMPTS.jsonl DTYPE [edge-agent flags...]
set -euo pipefail
OUT="$1"; PROMPTS="$2"; DTYPE="$3"; shift 3
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$PY" -m cloud --port "$PORT" --dtype "$DTYPE" >"$OUT/verifier.log" 2>&1 &
VERIFIER=$!
trap 'kill $VERIFIER 2>/dev/null || true; wait $VERIFIER 2>/dev/null || true' EXIT
until grep -q serving "$OUT/verifier.log"; do kill -0 $VERIFIER; sleep 1; done
for MODE in cloud_only speculative auto edge_only; do
  "$PY" -m edge --cloud "127.0.0.1:$PORT" --dtype "$DTYPE" --prompts "$PROMPTS" --mode "$MODE" \
      --output "$OUT/$MODE.jsonl" "$@" 2>"$OUT/$MODE.log"
done
"$PY" -m bench.summarize --output "$OUT/result.json" --run speculative="$OUT/speculative.jsonl" --run auto="$OUT/auto.jsonl" \
    --run cloud_only="$OUT/cloud_only.jsonl" --run edge_only="$OUT/edge_only.jsonl" | tee "$OUT/table.md"

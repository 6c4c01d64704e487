#!/usr/bin/env bash
# Start a cloud-verifier on a free loopback port, run edge-agent against it, stop the verifier.
set -euo pipefail
PY="$1"; PROMPT="$2"; shift 2
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
LOG=$(mktemp)
"$PY" -m cloud --port "$PORT" --http-port 0 >"$LOG" 2>&1 &
VERIFIER=$!
trap 'kill $VERIFIER 2>/dev/null || true; wait $VERIFIER 2>/dev/null || true; rm -f "$LOG"' EXIT
echo "cloud-verifier starting on 127.0.0.1:$PORT (log: $LOG)" >&2
for _ in $(seq 1 600); do
  if grep -q "serving" "$LOG"; then break; fi
  if ! kill -0 $VERIFIER 2>/dev/null; then cat "$LOG" >&2; exit 1; fi
  sleep 0.5
done
echo "--- speculative (edge drafts with Qwen2.5-Coder-0.5B, cloud verifies with 1.5B), each round ---" >&2
# A long soft deadline here keeps the round view to one line per round; the text run below
# shows provisional (dimmed) tokens while a slow CPU verifier works.
"$PY" -m edge --cloud "127.0.0.1:$PORT" --prompt "$PROMPT" --mode speculative --show-steps --verify-timeout-ms 10000 "$@"
echo "--- the same prompt in auto mode (the default: the target first, speculation when it measures faster) ---" >&2
"$PY" -m edge --cloud "127.0.0.1:$PORT" --prompt "$PROMPT" "$@"
echo "--- target model alone (cloud_only), for comparison ---" >&2
"$PY" -m edge --cloud "127.0.0.1:$PORT" --prompt "$PROMPT" --mode cloud_only "$@"

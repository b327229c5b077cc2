#!/usr/bin/env bash
# Where a realtime benchmark's server spends its time, on the GPU machine, in one call:
#
#   WHEELS=".whl-lean .whl-av .whl-spy" C=32 OUT=/path bash benchmarks/realtime_profile.sh
#
# The server of benchmarks/realtime.sh (released sizes, random bf16, colocated) run under py-spy (its wheel in
# .whl-spy/: `pip download --no-deps --only-binary=:all: py-spy -d .whl-spy`), sampling every thread's Python
# stack while it runs on a CPU, and under benchmarks/step_trace.py (--no-sync: each stage step's host time,
# the GPU left to run ahead); the manual-commit part of `omnistage.bench.realtime` at concurrency C against it,
# with the GPU's utilisation sampled by nvidia-smi every 200 ms. Under $OUT: realtime.log (the table, and the
# server's phases of end of speech to first audio), spy.txt (collapsed stacks per thread: `thread;frame;...
# count`), trace.json, gpu.csv, server.log, env.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-realtime-profile-out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
{ gpu_env_txt; git rev-parse HEAD 2>/dev/null; } >"$OUT/env.txt"
PORT=${PORT:-8321}
model=$(python3 -c 'from omnistage.bench.skeletons import released_skeleton; print(released_skeleton())') || exit
serve=(python3 benchmarks/step_trace.py --no-sync --out "$OUT/trace.json" -- serve --port "$PORT" --model "$model"
  --load-format dummy --config configs/qwen3omni_colocated.yaml --dtype bfloat16)
ready() { # wait for the server started as $1; fail if $1 ends first
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    kill -0 "$1" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}
"$SITE/bin/py-spy" record --nonblocking --threads --rate "${RATE:-50}" --format raw --output "$OUT/spy.txt" -- \
  "${serve[@]}" >"$OUT/server.log" 2>&1 &
spy=$!
if ! ready $spy; then # py-spy may not be let to read another process: the rest without it
  tail -5 "$OUT/server.log"
  pkill -TERM -f "^python3 benchmarks/step_trace.py"
  "${serve[@]}" >"$OUT/server.log" 2>&1 &
  spy=$!
  ready $spy || { tail -30 "$OUT/server.log"; exit 1; }
fi
nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 200 >"$OUT/gpu.csv" &
smi=$!
timeout -k 10 "${PART_S:-240}" python3 -m omnistage.bench.realtime --out-dir "$OUT" --url "http://127.0.0.1:$PORT" \
  --concurrency "${C:-32}" --turns "${TURNS:-5}" --barge-ins 0 >"$OUT/realtime.log" 2>&1
kill $smi
pkill -TERM -f "^python3 benchmarks/step_trace.py" # the trace is written as the server ends; then py-spy's stacks
wait $spy
grep -E "the server.s count|^\| " "$OUT/realtime.log"

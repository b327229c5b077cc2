#!/usr/bin/env bash
# Where an `omnistage` command's process spends its time, on the GPU machine: the command under py-spy,
# sampling every thread's Python stack while it runs on a CPU, with the GPU's utilisation sampled by
# nvidia-smi every 200 ms:
#
#   WHEELS=".whl-lean .whl-spy" OUT=/path bash benchmarks/spy.sh bench a2t --load-format dummy \
#       --skeleton qwen3-asr-0.6b --device cuda --concurrency 128 --rounds 8
#
# py-spy's wheel lives in .whl-spy/ (`pip download --no-deps --only-binary=:all: py-spy -d .whl-spy`). Under
# $OUT: command.log (the command's output), spy.txt (collapsed stacks per thread: `thread;frame;... count`),
# gpu.csv, summary.txt (benchmarks/profile_summary.py), env.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-spy-out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
{ gpu_env_txt; git rev-parse HEAD 2>/dev/null; } >"$OUT/env.txt"
nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 200 >"$OUT/gpu.csv" &
smi=$!
# SPY_ARGS=--gil: only the thread holding the interpreter lock is sampled, so the samples per thread are each
# thread's share of the lock (what the engine's thread waits for while the others run Python)
# shellcheck disable=SC2086
"$SITE/bin/py-spy" record --nonblocking --threads --rate "${RATE:-50}" ${SPY_ARGS:-} --format raw --output "$OUT/spy.txt" -- \
  python3 -m omnistage.cli "$@" >"$OUT/command.log" 2>&1
rc=$?
kill $smi
python3 benchmarks/profile_summary.py "$OUT" >"$OUT/summary.txt" 2>&1
grep -E "^\| " "$OUT/command.log"
head -40 "$OUT/summary.txt"
exit $rc

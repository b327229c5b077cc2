#!/usr/bin/env bash
# Realtime voice sessions (issue 31) on one H200 at the released sizes (random bf16 weights, the colocated
# config), in one call:
#
#   OUT=/path bash benchmarks/realtime.sh      # on the GPU machine; OUT defaults to ./realtime-out
#
# One `omnistage serve`, then `python -m omnistage.bench.realtime` (its docstring says what each part measures):
# at 1, 8 and 32 sessions at once, 5 turns of a 10 s utterance each, paced at real time in 100 ms chunks,
# commit to first audio in turns 1 and 5 (between turns the user hears the reply out and pauses up to THINK_S;
# LISTEN=no: the next turn at response.done); one server-VAD session, speech_stopped to first audio and three
# barge-ins; then turn 1 and turn 5 as whole /v1/chat/completions requests with nothing cached. About 480 s
# (start ~200 s, each concurrency ~90 s, VAD ~25 s, baseline ~15 s); each part under its own timeout.
# Under $OUT: env.txt, realtime.json, realtime.log, server.log; the table rows go to stdout.
# The CPU smoke test on the embedded tiny model:
#   DEVICE=cpu SERVE_ARGS="--device cpu" RELEASED=0 C=1,2 TURNS=2 UTTERANCE_S=3 OUT=/tmp/rt bash benchmarks/realtime.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-realtime-out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
if [[ ${DEVICE:-cuda} == cuda ]]; then
  { gpu_env_txt; git rev-parse HEAD 2>/dev/null; } >"$OUT/env.txt"
else
  { python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'; git rev-parse HEAD 2>/dev/null; } >"$OUT/env.txt"
fi
released=()
[[ ${RELEASED:-1} == 0 ]] || released=(--released)
listen=()
[[ ${LISTEN:-yes} != no ]] || listen=(--no-listen)
failed=0
timeout -k 30 "${REALTIME_S:-600}" python3 -m omnistage.bench.realtime --out-dir "$OUT" "${released[@]}" \
  --serve-args "${SERVE_ARGS:---config configs/qwen3omni_colocated.yaml --dtype bfloat16}" \
  --concurrency "${C:-1,8,32}" --turns "${TURNS:-5}" --utterance-s "${UTTERANCE_S:-10}" --pace "${PACE:-1}" \
  --max-output-tokens "${MAX_OUTPUT_TOKENS:-8}" --barge-ins "${BARGE_INS:-3}" --stagger-s "${STAGGER_S:-3}" \
  --think-s "${THINK_S:-1}" "${listen[@]}" \
  --part-timeout-s "${PART_S:-130}" >"$OUT/realtime.log" 2>&1 || failed=1
grep -E "ready in|failed|Error|: [0-9.]+ s$|the server.s count" "$OUT/realtime.log" | head -30
if grep -q "^The table:" "$OUT/realtime.log"; then
  sed -n '/^The table:/,$p' "$OUT/realtime.log"
else # cut short: the rows of the parts that ended
  grep -E "^\| " "$OUT/realtime.log"
fi
exit $failed

#!/usr/bin/env bash
# Constrained decoding's cost and the Thinking model's streamed reasoning on one H200 at the released sizes
# (random bf16 weights), in one call (benchmarks/constrained.py says what each part measures):
#
#   OUT=/path bash benchmarks/constrained.sh      # on the GPU machine, carrying .whl; OUT defaults to ./constrained-out
#
# 1. decode: the Qwen3-Omni Thinker in-process, TPOT at batch 1 and 32 under `response_format: json_schema`
#    beside the same batch free (and free without decoding ahead, which constrained steps do too), every
#    request forced to 128 tokens, 4 timed passes a side after a warm-up.
# 2. thinking: `omnistage serve` on a Qwen3-Omni-30B-A3B-Thinking skeleton, streamed chats of 128 tokens at
#    c = 1 and 32, 3 timed passes after a warm-up: reasoning deltas with the think block open, content deltas
#    with enable_thinking false; TTFT and TPOT of each.
# Each part has its own time limit (DECODE_S, THINKING_S; 240 s together). Under $OUT: env.txt, decode.{json,log},
# thinking.{json,log}, thinking_server.log; the table rows go to stdout. Every setting below can be overridden
# from the environment; a CPU smoke run on tiny checkpoints (`omnistage make-tiny`, with `--variant thinking`):
#
#   DEVICE=cpu DTYPE=float32 LOAD_FORMAT=safetensors MODEL=tiny THINKING_MODEL=tiny-thinking KV_GIB=0.25 \
#     TOKENS=16 BATCHES=1,4 REPEATS=2 bash benchmarks/constrained.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-constrained-out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
{ gpu_env_txt; python3 -c 'from importlib.metadata import version; print("xgrammar", version("xgrammar"))' 2>&1
  git rev-parse HEAD 2>/dev/null; } >"$OUT/env.txt"
common=(--device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --load-format "${LOAD_FORMAT:-dummy}"
  --kv-gib "${KV_GIB:-16}" --tokens "${TOKENS:-128}" --out-dir "$OUT")
failed=0
timeout -k 10 "${DECODE_S:-140}" python3 benchmarks/constrained.py decode "${common[@]}" ${MODEL:+--model "$MODEL"} \
  --batches "${BATCHES:-1,32}" --repeats "${REPEATS:-4}" >"$OUT/decode.log" 2>&1 || failed=1
grep -E "^\||^decode:|Error" "$OUT/decode.log" | head -20
timeout -k 10 "${THINKING_S:-100}" python3 benchmarks/constrained.py thinking "${common[@]}" \
  ${THINKING_MODEL:+--model "$THINKING_MODEL"} --concurrency "${BATCHES:-1,32}" --repeats "${THINKING_REPEATS:-3}" \
  --server-timeout "${SERVER_WAIT_S:-80}" >"$OUT/thinking.log" 2>&1 || failed=1
grep -E "^\||^thinking:|Error" "$OUT/thinking.log" | head -20
exit $failed

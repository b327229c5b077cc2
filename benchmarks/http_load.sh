#!/usr/bin/env bash
# Issue-27 load through HTTP, on the GPU machine, in one call: the colocated topology capped at 80 GiB
# (released sizes, random bf16) behind `omnistage serve`, then
# 1. `omnistage bench t2s --url` at c = 1, 4, 16, 32, 64 (40 text tokens and 125 frames forced, as
#    benchmarks/under_load.sh in-process), with --fail-on-build (the server's /metrics count of kernels and
#    graphs built while serving);
# 2. benchmarks/soak.py against the same server: mixed requests (chat, completions, transcriptions, audio and
#    image, video with its sound; some cut off by their clients) at concurrency SOAK_C, every KV page back
#    after, the RSS series with its verdict (a plateau required; SOAK_RSS_MIB bounds the growth, 1,024 by
#    default: the released model's server grew 330 MiB over its warm-up, past the tiny model's 256); then
#    /metrics' build count again.
#
#   OUT=/path bash benchmarks/http_load.sh        # carry .whl and .whl-av (the soak's video needs PyAV)
#
# Under $OUT: env.txt, server.log, t2s.json, speech_bench.log, soak.json, soak.log, builds.txt.
# T2S_REPEATS passes per concurrency (1); SOAK_N=0 leaves the soak out. SPY=1 runs the server under py-spy
# (WHEELS=".whl .whl-spy", as benchmarks/spy.sh): spy.txt and summary.txt, whose engine thread's samples
# are all serving (it starts after the graphs are captured).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-http-load-out}
SOAK_N=${SOAK_N:-600}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
{ gpu_env_txt; git rev-parse HEAD 2>/dev/null; } >"$OUT/env.txt"
PORT=${PORT:-8321}
url=http://127.0.0.1:$PORT
model=$(python3 -c 'from omnistage.bench.skeletons import released_skeleton; print(released_skeleton())') || exit
serve=(python3 -m omnistage.cli serve --port "$PORT" --model "$model" --load-format dummy --dtype bfloat16
  --config configs/qwen3omni_colocated.yaml --gpu-memory-limit-gib "${CAP_GIB:-80}")
if [[ -n ${SPY:-} ]]; then
  "$SITE/bin/py-spy" record --nonblocking --threads --rate "${RATE:-50}" --format raw --output "$OUT/spy.txt" \
    -- "${serve[@]}" >"$OUT/server.log" 2>&1 &
  spy=$!
  nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 200 >"$OUT/gpu.csv" &
  smi=$!
  for _ in $(seq 100); do server=$(pgrep -P $spy) && break; sleep 0.1; done
else
  "${serve[@]}" >"$OUT/server.log" 2>&1 &
  server=$!
fi
for _ in $(seq 600); do
  curl -sf "$url/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { tail -30 "$OUT/server.log"; exit 1; }
  sleep 0.5
done
builds() { curl -sf "$url/metrics" | grep -E "^omnistage_builds_while_serving" ; }
failed=0
timeout "${T2S_S:-240}" python3 -m omnistage.cli bench t2s --url "$url" --concurrency "${T2S_C:-1,4,16,32,64}" \
  --requests 2 --repeats "${T2S_REPEATS:-1}" --fail-on-build --out-dir "$OUT" >"$OUT/speech_bench.log" 2>&1 || failed=1
grep -E "^\| |built while|Error" "$OUT/speech_bench.log" | head -20
if [[ ${SOAK_N:-600} -gt 0 ]]; then
  timeout "${SOAK_S:-200}" python3 benchmarks/soak.py --url "$url" --pid $server --requests "$SOAK_N" \
    --concurrency "${SOAK_C:-32}" --rss-every 50 --require-plateau --max-rss-growth-mib "${SOAK_RSS_MIB:-1024}" \
    --json "$OUT/soak.json" >"$OUT/soak.log" 2>&1 || failed=1
  tail -25 "$OUT/soak.log"
fi
builds | tee "$OUT/builds.txt"
kill $server
if [[ -n ${SPY:-} ]]; then
  wait $spy
  kill $smi
  python3 benchmarks/profile_summary.py "$OUT" >"$OUT/summary.txt" 2>&1
  head -60 "$OUT/summary.txt"
else
  wait $server
fi
exit $failed

#!/usr/bin/env bash
# What lags under load (issue 27), in one call on the H200 at the released sizes (random bf16 weights):
#
#   OUT=/path bash benchmarks/under_load.sh      # on the GPU machine; OUT defaults to ./load-out
#
# 1. `omnistage bench t2s` in-process at c = 1, 4, 16, 32, 64, then s2s at c = 1, with the compile watch's
#    --fail-on-build and dynamo's recompile reasons in the log (TORCH_LOGS=recompiles): a shape start-up did
#    not warm shows as a build with its guard.
# 2. `omnistage bench a2t` on Qwen3-ASR 0.6B and 1.7B at c = 64, 128 (and 256 for the 0.6B), 33 tokens
#    forced, with --fail-on-build.
# Under $OUT: env.txt, t2s.json, s2s.json, speech_bench.log, asr_{0p6b,1p7b}{TAG}.{json,log}. T2S_REPEATS passes
# per concurrency (1); T2S_ARGS more flags for `bench t2s` (e.g. "--config configs/qwen3omni_colocated.yaml
# --gpu-memory-limit-gib 80", the topology benchmarks/http_load.sh serves); A2T_ARGS more flags for every
# `bench a2t` (e.g. "--rounds 8 --admission-hold-steps 4"), TAG a suffix of their files; T2S_C=" " leaves the
# speech part out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-load-out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
{ gpu_env_txt; git rev-parse HEAD 2>/dev/null; } >"$OUT/env.txt"
failed=0
t2s=${T2S_C-1,4,16,32,64}
if [[ -n ${t2s// /} ]]; then
  # shellcheck disable=SC2086  # T2S_ARGS is a list of flags
  TORCH_LOGS=${TORCH_LOGS:-recompiles} timeout "${SPEECH_S:-390}" python3 -m omnistage.cli bench t2s \
    --load-format dummy --device cuda --dtype bfloat16 --concurrency "$t2s" --requests 2 \
    --repeats "${T2S_REPEATS:-1}" --also s2s --also-concurrency 1 ${T2S_ARGS:-} \
    --fail-on-build --out-dir "$OUT" >"$OUT/speech_bench.log" 2>&1 || failed=1
  grep -E "^\| |built while|Recompiling|guard|engine start|Error" "$OUT/speech_bench.log" | head -60
fi
for spec in ${ASR:-0.6b:64,128,256 1.7b:64,128}; do
  size=${spec%%:*}
  name=asr_${size/./p}${TAG:-}
  # shellcheck disable=SC2086  # A2T_ARGS is a list of flags
  timeout "${A2T_S:-150}" python3 -m omnistage.cli bench a2t --load-format dummy --skeleton "qwen3-asr-$size" \
    --device cuda --concurrency "${spec#*:}" --repeats 2 --fail-on-build ${A2T_ARGS:-} --out "$OUT/$name.json" \
    >"$OUT/$name.log" 2>&1 || failed=1
  grep -E "^\| |built while|Error" "$OUT/$name.log" | head -20
done
exit $failed

#!/usr/bin/env bash
# Video in (issue 29) on one H200 at the released sizes (random bf16 weights), in one call:
#
#   OUT=/path bash benchmarks/video.sh      # on the GPU machine; OUT defaults to ./video-out
#
# One process, one weight load: `omnistage bench v2s` on 10, 30 and 120 s 1280x720 videos with their sound
# (use_audio_in_video, each sent as a video_url file as the server takes it) at c = 1 and 8, 40 text tokens and
# 125 codec frames (10 s of speech) forced per request: TTFT and its pieces (decode, processor, towers), first
# audio packet, RTF, audio s/s, with --fail-on-build; then transformers' generate(return_audio=True) on the very
# same weight tensors, one request per length up to BASELINE_MAX_S seconds (a length that runs out of memory is a
# note). The 120 s video is sampled at 1 fps where 2 would overflow the context (its fps is in the table).
# Under $OUT: env.txt, v2s.json (written as each length ends), v2s.log; the table rows go to stdout.
# Every setting below can be overridden from the environment (e.g. LENGTHS=10,30 BASELINE=0); V2S_ARGS adds
# flags (e.g. "--max-num-batched-tokens 8192").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-video-out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
{ gpu_env_txt; git rev-parse HEAD 2>/dev/null; } >"$OUT/env.txt"
baseline=()
[[ ${BASELINE:-1} == 0 ]] || baseline=(--baseline transformers --baseline-max-seconds "${BASELINE_MAX_S:-30}")
failed=0
# shellcheck disable=SC2086  # V2S_ARGS is a list of flags
timeout "${V2S_S:-450}" python3 -m omnistage.cli bench v2s --load-format dummy --device cuda --dtype bfloat16 \
  --video-seconds "${LENGTHS:-10,30,120}" --resolution "${RESOLUTION:-1280x720}" --concurrency "${C:-1,8}" \
  --requests "${REQUESTS:-1}" --text-tokens "${TEXT_TOKENS:-40}" --frames "${FRAMES:-125}" \
  --kv-cache-memory-gib "${KV_GIB:-32}" "${baseline[@]}" --fail-on-build ${V2S_ARGS:-} --out-dir "$OUT" \
  >"$OUT/v2s.log" 2>&1 || failed=1
grep -E "^\| |^ours, |^v2s:|pools after|built while|failed|Error|engine start" "$OUT/v2s.log" | head -80
exit $failed

#!/usr/bin/env bash
# Speech out on one H200 at the released sizes (random bf16 weights): the run benchmarks/RESULTS.md records.
#
#   OUT=/path bash benchmarks/speech.sh      # on the GPU machine, any directory; OUT defaults to ./speech-out
#
# 1. One process, one weight load: `omnistage bench t2s` at c = 1, 4, 16, 32, then s2s (a 5 s clip in) at
#    c = 1, then transformers' generate(return_audio=True) on the very same weight tensors, c = 1, for both
#    (it does not stream: its first packet is its whole time). 40 text tokens and 125 frames (10 s of
#    audio) forced per request. Its JSON is written as each part ends, so a run cut short keeps its figures.
# 2. tests/gpu/test_speech_gpu.py (one weight load, eager; SKIP_GPU_TEST=1 skips it): one S2S request and eight
#    concurrent T2S requests complete with the frames forced, and every stage's pages are free afterwards.
# Under $OUT: env.txt, test_speech_gpu.log, speech_bench.log, t2s.json, s2s.json. The two steps are capped
# at 400 s and 170 s so that the whole fits one 10-minute call.
#
# The GPU image lacks some of omnistage's dependencies (pydantic, soundfile, the tokenizer...): wheels in the
# repository's ignored .whl/ folder, carried with the call, are installed first (benchmarks/gpu_env.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-speech-out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
gpu_env_txt >"$OUT/env.txt"

failed=0
timeout 400 python3 -m omnistage.cli bench t2s --load-format dummy --device cuda --dtype bfloat16 \
  --concurrency 1,4,16,32 --requests 3 --also s2s --also-concurrency 1 \
  --baseline transformers --baseline-requests 2 --out-dir "$OUT" 2>&1 | tee "$OUT/speech_bench.log" || failed=1
[[ ${SKIP_GPU_TEST:-} ]] || timeout 170 python3 -m pytest -x -q -rs -p no:cacheprovider tests/gpu/test_speech_gpu.py 2>&1 | tee "$OUT/test_speech_gpu.log" || failed=1
exit $failed

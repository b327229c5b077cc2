#!/usr/bin/env bash
# Qwen3-ASR on one H200 at the released sizes (random bf16 weights), ours and transformers from one run each:
#
#   OUT=/path bash benchmarks/asr.sh      # on the GPU machine; OUT defaults to ./asr-out
#
# 1. tests/gpu/test_asr_gpu.py (SKIP_GPU_TEST=1 skips it): graphs == eager on the tiny checkpoint; the 0.6B
#    sizes transcribe a batch.
# 2. `omnistage bench a2t --skeleton qwen3-asr-1.7b` then `qwen3-asr-0.6b`: in-process at c = 1, 16, 64, 128 on
#    the 20 LibriSpeech-like clips (94 s; above 20 a pass cycles over the set whole times), 33 tokens forced,
#    two passes each, then transformers' Qwen3-ASR on the very weight tensors, one request at a time.
# 3. The 1.7B on one 2-minute clip at c = 1, 400 tokens forced (LibriSpeech's ~3.3 tokens per second of
#    speech), with transformers. Under $OUT: env.txt, test_asr_gpu.log, asr_{1p7b,0p6b,1p7b_2min}.json, logs.
# The GPU image lacks some dependencies: wheels in the repository's ignored .whl/ folder, carried with the call,
# are installed first (benchmarks/gpu_env.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-asr-out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
python3 -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)' >"$OUT/env.txt" 2>&1
failed=0
[[ ${SKIP_GPU_TEST:-} ]] || timeout 150 python3 -m pytest -x -q -rs -p no:cacheprovider tests/gpu/test_asr_gpu.py 2>&1 | tee "$OUT/test_asr_gpu.log" || failed=1
for size in 1.7b 0.6b; do
  timeout 170 python3 -m omnistage.cli bench a2t --load-format dummy --skeleton "qwen3-asr-$size" --device cuda \
    --concurrency 1,16,64,128 --repeats 2 --baseline transformers --out "$OUT/asr_${size/./p}.json" \
    >"$OUT/asr_${size/./p}.log" 2>&1 || failed=1
  grep -A8 "^| target" "$OUT/asr_${size/./p}.log"
done
timeout 120 python3 -m omnistage.cli bench a2t --load-format dummy --skeleton qwen3-asr-1.7b --device cuda --synth 2min \
  --output-tokens 400 --concurrency 1 --repeats 3 --baseline transformers --out "$OUT/asr_1p7b_2min.json" \
  >"$OUT/asr_1p7b_2min.log" 2>&1 || failed=1
grep -A4 "^| target" "$OUT/asr_1p7b_2min.log"
exit $failed

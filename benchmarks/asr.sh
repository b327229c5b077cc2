#!/usr/bin/env bash
# Qwen3-ASR on one H200 at the released sizes (random bf16 weights), ours and transformers from one run each:
#
#   OUT=/path bash benchmarks/asr.sh      # on the GPU machine; OUT defaults to ./asr-out
#
# 1. tests/gpu/test_asr_gpu.py: graphs == eager on the tiny checkpoint; the 0.6B sizes transcribe a batch.
# 2. `omnistage bench a2t --skeleton qwen3-asr-0.6b` then `qwen3-asr-1.7b`: in-process at c = 1, 8, 20 (all the clips at once) on
#    the 20 LibriSpeech-like clips (94 s), 33 tokens forced, then transformers' Qwen3-ASR on the very weight
#    tensors, one request at a time. Under $OUT: env.txt, test_asr_gpu.log, asr_0p6b.json, asr_1p7b.json, logs.
# The GPU image lacks some dependencies: wheels in the repository's ignored .whl/ folder, carried with the call,
# are installed into /tmp/site first (as benchmarks/speech.sh does).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-asr-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)' >"$OUT/env.txt" 2>&1
failed=0
timeout 150 python3 -m pytest -x -q -rs -p no:cacheprovider tests/gpu/test_asr_gpu.py 2>&1 | tee "$OUT/test_asr_gpu.log" || failed=1
for size in 0.6b 1.7b; do
  timeout 200 python3 -m omnistage.cli bench a2t --load-format dummy --skeleton "qwen3-asr-$size" --device cuda \
    --concurrency 1,8,20 --repeats 3 --baseline transformers --out "$OUT/asr_${size/./p}.json" \
    2>&1 | tee "$OUT/asr_${size/./p}.log" || failed=1
done
exit $failed

#!/usr/bin/env bash
# Every stage under an 80 GiB cap at the released sizes (random bf16 weights): the runs benchmarks/RESULTS.md
# records for the colocated and two-GPU topologies.
#
#   OUT=/path bash benchmarks/fit80.sh colocated [extra fit80.py flags]   # one H200 (nvidia-h200)
#   OUT=/path bash benchmarks/fit80.sh 2gpu [extra fit80.py flags]        # two H200s (nvidia-h200-x2)
#
# colocated: configs/qwen3omni_colocated.yaml capped at 80 GiB; the batch of large requests (images up to
#   3840x2160, a 300 s clip, 2 S2S and 2 T2S at once), then A2T c=1 over the LibriSpeech-like set, then the
#   pipeline released and rebuilt without the cap for the same A2T pass (both RTFs and their ratio).
# 2gpu: configs/qwen3omni_2gpu.yaml capped at 80 GiB on each GPU; the same batch, no A2T.
# Under $OUT: env.txt, fit80_<mode>.log and fit80_<config>_80gib.json (written as each part ends, so a run cut
# short keeps what it measured). The run is capped at 560 s so that the whole fits one 10-minute call.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-colocated}
shift || true
OUT=${OUT:-fit80-out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
} >"$OUT/env.txt" 2>&1

case $MODE in
  colocated) args=(--config configs/qwen3omni_colocated.yaml --a2t-compare --uncapped) ;;
  2gpu) args=(--config configs/qwen3omni_2gpu.yaml) ;;
  *) echo "usage: OUT=... bash benchmarks/fit80.sh colocated|2gpu [fit80.py flags]" >&2; exit 2 ;;
esac
timeout 560 python3 benchmarks/fit80.py "${args[@]}" --gpu-memory-limit-gib 80 --out-dir "$OUT" "$@" 2>&1 \
  | tee "$OUT/fit80_$MODE.log"
exit "${PIPESTATUS[0]}"

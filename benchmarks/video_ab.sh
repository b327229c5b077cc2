#!/usr/bin/env bash
# The vision tower's compiled blocks (issue 29), on the GPU machine, in one call:
#
#   bash benchmarks/before_after.sh export REV            # here: the earlier tree in .ab/
#   OUT=$OUT bash benchmarks/video_ab.sh [PART...]          # there, carrying .whl-lite, .whl-av and .ab
#
# Parts (all, in this order, when none is named):
# - tower:  benchmarks/vision_tower.py --compile (the tower alone, eager then compiled, same weights);
# - test:   tests/gpu/test_encoder_graphs_gpu.py (compiled rows equal the eager ones, nothing built after start);
# - after:  benchmarks/video.sh on this tree (30 s and 10 s 720p videos with their sound at c = 1 and 8, KV_GIB=4,
#           8,192 tokens a step, no transformers baseline: it does not fit beside ours on an 80 GB card);
# - before: the same on the tree in .ab/.
# Under $OUT/<part>/ each part's files, and $OUT/video_ab.tgz with them all, packed after each part.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-video-ab-out}
mkdir -p "$OUT"
export WHEELS=${WHEELS:-.whl-lite .whl-av}
source benchmarks/gpu_env.sh
export WHEELS=" "  # installed once: video.sh sources gpu_env.sh again and skips it
video=(env LENGTHS=30,10 C=1,8 BASELINE=0 KV_GIB=4 V2S_S=230 V2S_ARGS="--max-num-batched-tokens 8192")
for part in ${*:-tower test after before}; do
  mkdir -p "$OUT/$part"
  echo "video_ab: $part at ${SECONDS} s"
  case $part in
    tower) timeout 200 python3 benchmarks/vision_tower.py --compile --out "$OUT/tower/vision_tower.json" 2>&1 |
      tee "$OUT/tower/vision_tower.log" | grep -E "^\||compiled" ;;
    test) timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_encoder_graphs_gpu.py \
      >"$OUT/test/test_encoder_graphs_gpu.log" 2>&1; tail -3 "$OUT/test/test_encoder_graphs_gpu.log" ;;
    after) OUT=$OUT/after "${video[@]}" bash benchmarks/video.sh ;;
    before) OUT=$OUT/before "${video[@]}" bash .ab/benchmarks/video.sh ;;
    *) echo "video_ab: no part $part (tower, test, after, before)" >&2; exit 2 ;;
  esac
  tar czf "$OUT/video_ab.tgz" -C "$OUT" --exclude video_ab.tgz .
done

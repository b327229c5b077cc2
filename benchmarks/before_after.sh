#!/usr/bin/env bash
# The same workloads on an earlier commit and on this tree, back to back on one GPU machine: what a
# restructure must leave as it was (A2T, T2S, the colocated topology at 80 GiB).
#
#   bash benchmarks/before_after.sh export REV            # here: REV's omnistage/, benchmarks/, configs/ in .ab/
#   OUT=/path bash benchmarks/before_after.sh run t2s a2t   # on the GPU machine, carrying .ab and .whl
#   OUT=/path bash benchmarks/before_after.sh run fit80
#   AB=.ab2 bash benchmarks/before_after.sh export REV2   # a second earlier tree beside the first (AB: its folder)
#
# Parts, each run on the earlier tree (.ab/, "before") then on this one ("after"):
# - a2t: `omnistage bench a2t`, Qwen3-Omni released sizes (random bf16), the LibriSpeech-like set, 33 tokens
#   forced, c = 1 and 16, 3 timed passes each (medians);
# - t2s: `omnistage bench t2s`, c = 1 and 16 (T2S_C: other concurrencies), 2 requests per stream (first
#   packet, RTF medians);
# - fit80: configs/qwen3omni_colocated.yaml under an 80 GiB cap, its start (graphs captured per stage) and
#   its batch of large requests (benchmarks/fit80.py without the A2T passes);
# - asr: `omnistage bench a2t`, Qwen3-ASR 0.6B (random bf16), the LibriSpeech-like set, 33 tokens forced,
#   c = 64 and 128 in the steady state (`--rounds 8`; ASR_C: other concurrencies), 2 passes each;
# - prefill_attention: this tree's benchmarks/prefill_attention.py over each tree's kernels (one layer of a
#   loaded server's step and of a long prompt's chunks);
# - video: `omnistage bench v2s`, eight 10 s 720p videos with their sound at once (40 text tokens, 125 frames
#   forced; KV_GIB of KV, 4 by default as an 80 GB card holds): the c=8 RTF and first packets the scheduler's
#   order of prefills moves.
# Each run has its own time limit (A2T_S, T2S_S, FIT80_S) so that a slow one cannot take the others' time;
# TREES="after" runs this tree alone (a part re-run after a fix, beside the earlier call's "before").
# Under $OUT: env.txt, summary.txt (each run's table rows) and ab.tgz (per part and tree <part>_<tree>.log and
# its JSON), a run cut short keeping what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
here=$PWD
ab=${AB:-.ab}

if [[ ${1:-} == export ]]; then
  rev=$(git rev-parse --short "${2:?usage: before_after.sh export REV}")
  rm -rf "$ab" && mkdir -p "$ab"
  git archive "$rev" omnistage benchmarks configs | tar -x -C "$ab"
  echo "$rev" >"$ab/REV"
  echo "$ab: $rev"
  exit 0
fi
[[ ${1:-} == run && -f $ab/REV ]] || { echo "usage: before_after.sh export REV, then run PART..." >&2; exit 2; }
shift
OUT=${OUT:-ab-out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh  # the wheels into /tmp/site
{ gpu_env_txt; echo "before: $(cat "$ab/REV")"; } >"$OUT/env.txt"
bench=(--load-format dummy --device cuda --dtype bfloat16)
failed=0

one() {  # part tree seconds command...: the command in the tree's folder, with only its own omnistage
  local part=$1 tree=$2 limit=$3 dir=$here
  shift 3
  [[ $tree == before ]] && dir=$here/$ab
  (cd "$dir" && PYTHONPATH="$dir:/tmp/site" timeout "$limit" "$@") >"$OUT/${part}_$tree.log" 2>&1 || failed=1
  grep -E "^\| |started in|Error" "$OUT/${part}_$tree.log" | head -20 | tee -a "$OUT/summary.txt"
}

for part in "$@"; do
  for tree in ${TREES:-before after}; do
    echo "== $part, $tree" | tee -a "$OUT/summary.txt"
    case $part in
      a2t) one a2t "$tree" "${A2T_S:-150}" python3 -m omnistage.cli bench a2t "${bench[@]}" --output-tokens 33 \
        --concurrency 1,16 --repeats 3 --out "$OUT/a2t_$tree.json" ;;
      t2s) one t2s "$tree" "${T2S_S:-200}" python3 -m omnistage.cli bench t2s "${bench[@]}" --concurrency "${T2S_C:-1,16}" \
        --requests 2 --out-dir "$OUT/t2s_$tree" ;;
      fit80) one fit80 "$tree" "${FIT80_S:-240}" python3 benchmarks/fit80.py \
        --config configs/qwen3omni_colocated.yaml --gpu-memory-limit-gib 80 --batch-timeout-s 90 \
        --out-dir "$OUT/fit80_$tree" ;;
      asr) one asr "$tree" "${ASR_S:-240}" python3 -m omnistage.cli bench a2t "${bench[@]}" \
        --skeleton qwen3-asr-0.6b --concurrency "${ASR_C:-64,128}" --rounds 8 --repeats 2 --fail-on-build \
        --out "$OUT/asr_$tree.json" ;;
      video) one video "$tree" "${VIDEO_S:-240}" python3 -m omnistage.cli bench v2s "${bench[@]}" \
        --video-seconds 10 --resolution 1280x720 --concurrency 8 --requests 1 --text-tokens 40 --frames 125 \
        --kv-cache-memory-gib "${KV_GIB:-4}" --fail-on-build --out-dir "$OUT/video_$tree" ;;
      prefill_attention) one prefill_attention "$tree" "${ATTENTION_S:-120}" python3 \
        "$here/benchmarks/prefill_attention.py" --out "$OUT/prefill_attention_$tree.json" ;;
      *) echo "unknown part: $part" >&2; exit 2 ;;
    esac
  done
done
(cd "$OUT" && tar czf ab.tgz --exclude ab.tgz --exclude env.txt --exclude summary.txt ./*_before* ./*_after*)
exit $failed

#!/usr/bin/env bash
# Qwen3-ASR 0.6B replicas on Ray Serve against the single server, one H200, one call (random bf16 weights at the
# released sizes; benchmarks/ray_asr.py says what each part does):
#
#   OUT=/path bash benchmarks/ray_asr.sh      # on the GPU machine; OUT defaults to ./ray-asr-out
#
# 1. The single server: audio s/s at c = 128 on the 20 LibriSpeech-like clips (33 tokens forced), and the TTFT
#    of one request at a time (c = 1).
# 2. `omnistage serve --ray` with 1, 2 and 4 replicas on the one card (1/N of it each, and 1/N of MEMORY_GIB
#    when they share it): the same c = 128 pass through Serve's proxy, and c = 1 with one replica.
# Each part under its own timeout (70 + 100 + 95 + 125 s at most, and the install's ~20 s). Under $OUT, renewed
# after each part (a device call brings 8 files back): env.txt, table.md (also on stdout), ray_asr.json (every
# part's passes) and parts.tar.gz (each part's JSON, its log and its server's). Ray travels in .whl-ray/
# (benchmarks/ray_wheels.sh) and the server's dependencies in .whl/ (benchmarks/gpu_wheels.sh), installed first
# (benchmarks/gpu_env.sh).
#
# A CPU smoke run (the tiny checkpoint, two clips, c = 4, the parts given room for a slow CPU):
#   DEVICE=cpu MODEL=tiny C=4 REPLICAS=1,2 LIMIT=2 REPEATS=1 SINGLE_S=150 RAY_S=240 bash benchmarks/ray_asr.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-ray-asr-out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-released}
C=${C:-128}
REPLICAS=${REPLICAS:-1,2,4}
MEMORY_GIB=${MEMORY_GIB:-120}  # what the replicas of one card share
{
  [[ $DEVICE == cuda ]] && gpu_env_txt
  python3 -c 'import ray; print("ray", ray.__version__, ray.__file__)' 2>&1
  git rev-parse HEAD 2>/dev/null
} >"$OUT/env.txt"
cat "$OUT/env.txt"
work=$(mktemp -d)
common=(--model "$MODEL" --device "$DEVICE" --concurrency "$C" --repeats "${REPEATS:-2}" --out-dir "$work"
  ${LIMIT:+--limit "$LIMIT"})
failed=0
part() {  # part SECONDS NAME ARGS...
  timeout -k 30 "$1" python3 benchmarks/ray_asr.py part "${@:3}" "${common[@]}" >"$work/part_$2.log" 2>&1 || {
    rc=$? failed=1
    echo "part $2 failed (exit $rc); the end of its log:"
    tail -5 "$work/part_$2.log"
  }
  python3 benchmarks/ray_asr.py table --out-dir "$work" --json "$OUT/ray_asr.json" >"$OUT/table.md"
  tar -czf "$OUT/parts.tar.gz" -C "$work" .
}
part "${SINGLE_S:-70}" single single --ttft
for n in ${REPLICAS//,/ }; do
  ttft=()
  [[ $n == 1 ]] && ttft=(--ttft)
  seconds=${RAY_S:-$((n == 1 ? 100 : n < 4 ? 95 : 125))}  # four replicas build their graphs side by side
  bench_s=$((n == 1 ? 30 : 20))  # what the benchmark takes after the start, c = 1 the most
  part "$seconds" "ray$n" ray --replicas "$n" --memory-gib "$MEMORY_GIB" "${ttft[@]}" --ready-timeout $((seconds - bench_s))
done
cat "$OUT/table.md"
exit $failed

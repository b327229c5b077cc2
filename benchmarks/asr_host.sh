#!/usr/bin/env bash
# Where Qwen3-ASR's host-bound rate at c=128 goes (issue 27 item 4), on the GPU machine:
#
#   WHEELS=".whl-lite .whl-spy" OUT=/path bash benchmarks/asr_host.sh
#
# 1. `omnistage bench a2t` on the 0.6B (random bf16) at c=128 as benchmarks/under_load.sh runs it (the
#    LibriSpeech-like set, 33 tokens forced, --rounds 16, 2 passes), once per interpreter switch interval in
#    SWITCH ("0.005 0.001 0.0002": 5 ms is CPython's default). A thread that released the GIL for a torch call
#    waits up to that interval to take it back from whichever of the server's threads holds it.
# 2. The same bench (one pass) under py-spy with native frames (`--native`), every thread: what the engine's
#    thread runs below its Python lines (summary in spy_native.txt's per-thread tops).
# Under $OUT: env.txt, asr_si{interval}.{json,log}, spy_native.txt, asr_spy.log, and host.tgz holding them all.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-asr-host-out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
{ gpu_env_txt; git rev-parse HEAD 2>/dev/null; } >"$OUT/env.txt"
bench=(bench a2t --load-format dummy --skeleton qwen3-asr-0.6b --device cuda --concurrency 128 --rounds 16
  --fail-on-build)
failed=0
for si in ${SWITCH:-0.005 0.001 0.0002}; do
  timeout 150 python3 -c "import sys; sys.setswitchinterval($si); from omnistage.cli.parser import main; sys.exit(main())" \
    "${bench[@]}" --repeats 2 --out "$OUT/asr_si$si.json" >"$OUT/asr_si$si.log" 2>&1 || failed=1
  echo "switch interval $si s:"
  grep -E "^\| ours|built while|Error" "$OUT/asr_si$si.log"
done
if [[ -x $SITE/bin/py-spy ]]; then
  timeout 150 "$SITE/bin/py-spy" record --native --threads --rate 100 --format raw \
    --output "$OUT/spy_native.txt" -- python3 -m omnistage.cli "${bench[@]}" --repeats 1 >"$OUT/asr_spy.log" 2>&1 || failed=1
  grep -E "^\| ours" "$OUT/asr_spy.log"
fi
tar czf "$OUT/host.tgz" -C "$OUT" --exclude host.tgz .
exit $failed

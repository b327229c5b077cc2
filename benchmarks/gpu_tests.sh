#!/usr/bin/env bash
# Every GPU test file in a pytest process of its own, so that a crash in one (a CUDA error poisons the whole
# process) cannot hide the others' results:
#
#   OUT=/path bash benchmarks/gpu_tests.sh [test files...]     # on the GPU machine; default: tests/gpu/test_*.py
#   MARKS=slow bash benchmarks/gpu_tests.sh tests/gpu/test_engine_gpu.py    # only the slow tests; MARKS= : all
#
# MARKS is pytest's -m expression, "not slow" by default: the tests marked slow start engines of their own,
# past the ~90 s per file that lets the whole suite fit one 10-minute call. Each log ends with its slowest
# tests (--durations).
# The two-GPU tests run only where two GPUs are. Each file's log goes into $OUT/gpu_tests.tgz, a summary line
# per file to stdout and $OUT/gpu_tests.txt. The GPU image lacks some dependencies: wheels in the repository's
# ignored .whl/ folder, carried with the call, are installed first (benchmarks/gpu_env.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT/gpu_tests"
source benchmarks/gpu_env.sh
gpus=$(nvidia-smi -L | wc -l)
failed=0
marks=${MARKS-not slow}
files=("$@")
[[ ${#files[@]} -gt 0 ]] || files=(tests/gpu/test_*.py)
for file in "${files[@]}"; do
  if [[ $file == *two_gpu* && $gpus -lt 2 ]]; then
    continue
  fi
  name=$(basename "$file" .py)
  start=$SECONDS
  timeout "${PER_FILE_S:-200}" python3 -m pytest -q -rs -p no:cacheprovider --tb=short --durations=5 \
    ${marks:+-m "$marks"} "$file" >"$OUT/gpu_tests/$name.log" 2>&1
  rc=$?
  [[ $rc -eq 0 || $rc -eq 5 ]] || failed=1  # 5: MARKS left none of the file's tests
  echo "$name ($((SECONDS - start)) s): $(grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|deselected|error)' "$OUT/gpu_tests/$name.log" | tail -4 | tr '\n' ' ')" | tee -a "$OUT/gpu_tests.txt"
done
tar czf "$OUT/gpu_tests.tgz" -C "$OUT" gpu_tests && rm -r "$OUT/gpu_tests"
exit $failed

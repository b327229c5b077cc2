#!/usr/bin/env bash
# `make test`: the suite in four pytest processes, two at a time, or one pytest run where ARGS names tests.
#
#   PYTHON=.venv/bin/python ARGS="--durations=10" bash tests/run_groups.sh
#
# Each process is a group of the suite, so that what one part's engines, Ray and browsers leave in memory is
# given back when it ends (a process's heap does not shrink back: one process for all of it outgrew 24 GiB).
# Two streams of two groups run side by side, balanced by the groups' durations: much of the suite waits on
# servers, subprocesses and sockets, so on 2 cores the pair ends well before the four would one after another
# (CONTRIBUTING.md, "Testing on the CPU"). All processes share one directory of tiny checkpoints
# (tests/conftest.py), each made once. A group's output is printed whole when it ends. pytest's exit 5 (nothing
# collected, e.g. a filtered run) is no failure.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
ARGS=${ARGS:-}
checkpoints=$(mktemp -d)
logs=$(mktemp -d)
trap 'rm -rf "$checkpoints" "$logs"' EXIT
export OMNISTAGE_TEST_CHECKPOINTS=$checkpoints

# group LOG PATHS...: pytest over PATHS with ARGS, its output kept in LOG and printed once it ends
group() {
  local log=$1 rc=0
  shift
  # shellcheck disable=SC2086 # ARGS and the group's paths are words
  "$PYTHON" -m pytest -q $ARGS "$@" >"$log" 2>&1 || rc=$?
  flock "$logs/print.lock" cat "$log"
  ((rc == 5)) && rc=0
  return $rc
}

# stream NAME GROUP...: the groups one after another; fails if any of them did
stream() {
  local name=$1 rc=0 i=0 paths
  shift
  for paths in "$@"; do
    # shellcheck disable=SC2086
    group "$logs/$name-$((i++)).log" $paths || rc=1
  done
  return $rc
}

if [[ $ARGS == *tests/* ]]; then
  rc=0
  # shellcheck disable=SC2086
  "$PYTHON" -m pytest -q $ARGS || rc=$?
  exit $((rc == 5 ? 0 : rc))
fi
unit_rest="tests/unit --ignore=tests/unit/bench --ignore=tests/unit/engine"
stream a "tests/browser tests/gpu tests/parity tests/replicas" "tests/server" &
a=$!
stream b "tests/test_*.py tests/unit/bench tests/unit/engine" "$unit_rest" &
b=$!
rc=0
wait $a || rc=1
wait $b || rc=1
exit $rc

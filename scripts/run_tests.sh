#!/usr/bin/env bash
# make test's runner: the whole suite in two streams on one machine.
#
# Tests marked `background` spend their time waiting (for timeouts, for dying processes, for
# Horovod's elastic driver to re-form a job), as do the C++ tests; they run alongside the rest,
# which mostly computes. Each stream has a wall-clock limit; the script waits for both, prints
# the background stream's report after the main one's, and fails if either failed.
#
# usage: scripts/run_tests.sh PYTHON CPP_TESTS [PYTEST_ARGS...]
set -uo pipefail
cd "$(dirname "$0")/.."

python=$1
cpp_tests=$2
shift 2
limit=${FASTHOROVOD_TEST_LIMIT_SECONDS:-2400}
logs=build/test-logs
mkdir -p "$logs"
rm -f "$logs/cpp.rc" "$logs/background.rc"

started=$(date +%s)
trap 'trap - INT TERM; kill 0' INT TERM  # an interrupted make test takes both streams with it
# The background stream: the C++ tests, then the waiting tests (their own pytest temp directory,
# no cache writes, so that the two pytest runs share nothing on disk).
(
    timeout --kill-after=30 "$limit" "$cpp_tests" > "$logs/cpp.log" 2>&1
    echo "cpp rc=$?" > "$logs/cpp.rc"
    timeout --kill-after=30 "$limit" "$python" -m pytest -q -m background -p no:cacheprovider \
        --basetemp="$logs/background-tmp" --durations=20 "$@" tests > "$logs/background.log" 2>&1
    echo "background rc=$?" > "$logs/background.rc"
) &
background=$!

timeout --kill-after=30 "$limit" "$python" -m pytest -q -m "not background" --durations=40 "$@" tests
main_rc=$?

wait "$background"
cpp_rc=$(sed -n 's/^cpp rc=//p' "$logs/cpp.rc" 2>/dev/null)
background_rc=$(sed -n 's/^background rc=//p' "$logs/background.rc" 2>/dev/null)

echo
echo "=== C++ tests (ran alongside) ==="
tail -n 3 "$logs/cpp.log"
[ "${cpp_rc:-1}" = 0 ] || { echo "C++ tests failed (rc ${cpp_rc:-none}); their log:"; cat "$logs/cpp.log"; }
echo "=== tests marked background (ran alongside) ==="
cat "$logs/background.log"
echo "make test: $(( $(date +%s) - started )) s (main stream rc $main_rc, C++ rc ${cpp_rc:-none}, background rc ${background_rc:-none})"
[ "$main_rc" = 0 ] && [ "${cpp_rc:-1}" = 0 ] && [ "${background_rc:-1}" = 0 ]

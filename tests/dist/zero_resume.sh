#!/usr/bin/env bash
# A sharded checkpoint saved on 3 ranks (stage 2, after 2 steps) restores on 2 ranks (stage 3) and
# the third step ends with bitwise the parameters 3 steps on one process give.
#   zero_resume.sh MPIRUN TEST_ZERO
set -euo pipefail
mpirun=$1
test_zero=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
run() { "$mpirun" --allow-run-as-root --oversubscribe "$@" "$test_zero" -tc="resume across*" -s 2>&1; }
out=$(run -np 3 -x LINUM_ZERO_SAVE="$dir") || { echo "$out"; echo "FAIL: saving on 3 ranks failed"; exit 1; }
ls "$dir"
out=$(run -np 2 -x LINUM_ZERO_RESUME="$dir") || { echo "$out"; echo "FAIL: resuming on 2 ranks failed"; exit 1; }
resumed=$(grep -o "zero_checksum [0-9a-f]*" <<<"$out" | awk '{print $2}')
out=$(run -np 1) || { echo "$out"; echo "FAIL: the one-process run failed"; exit 1; }
alone=$(grep -o "zero_checksum [0-9a-f]*" <<<"$out" | awk '{print $2}')
echo "saved on 3 ranks, resumed on 2: $resumed; one process: $alone"
[ -n "$resumed" ] && [ "$resumed" = "$alone" ] || { echo "FAIL: the resumed parameters differ"; exit 1; }
echo "same parameters after resuming on another rank count"

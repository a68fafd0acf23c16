#!/usr/bin/env bash
# A rank that throws ends the whole job within seconds with an error naming the rank.
#   rank_failure.sh MPIRUN DIST_RANK_FAILURE [reproducible|fast|sharded]
set -uo pipefail
start=$(date +%s)
out=$(timeout 60 "$1" --allow-run-as-root --oversubscribe -np 3 "$2" ${3:-} 2>&1)
status=$?
elapsed=$(( $(date +%s) - start ))
echo "$out" | tail -20
echo "exit status $status after ${elapsed}s"
[ "$status" -ne 124 ] || { echo "FAIL: the job hung (killed by timeout)"; exit 1; }
[ "$status" -ne 0 ] || { echo "FAIL: the job reported success"; exit 1; }
grep -q "rank 1 of 3: injected failure in the loss (step 2)" <<<"$out" || { echo "FAIL: no error naming rank 1"; exit 1; }
[ "$elapsed" -le 30 ] || { echo "FAIL: took ${elapsed}s to end"; exit 1; }
echo "the job ended with rank 1's error"

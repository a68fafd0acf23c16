#!/usr/bin/env bash
# Reproducible data parallelism across rank counts: the same training under `mpirun -np 1`, `-np 2`
# and `-np 3` must end with bitwise the same parameters. (Ranks also run different OpenMP thread
# counts here: Open MPI binds 1 or 2 ranks to one core each and leaves 3 unbound.)
#   same_checksum.sh MPIRUN TEST_DIST
set -euo pipefail
mpirun=$1
test_dist=$2
sums=()
for n in 1 2 3; do
  out=$("$mpirun" --allow-run-as-root --oversubscribe -np "$n" "$test_dist" -tc="reproducible mode: three*" -s 2>&1) || {
    echo "$out"; echo "FAIL: the training under -np $n failed"; exit 1; }
  sum=$(grep -o "params_checksum [0-9a-f]* on $n rank" <<<"$out" | awk '{print $2}')
  [ -n "$sum" ] || { echo "$out"; echo "FAIL: no checksum printed under -np $n"; exit 1; }
  echo "-np $n: params_checksum $sum"
  sums+=("$sum")
done
[ "${sums[0]}" = "${sums[1]}" ] && [ "${sums[1]}" = "${sums[2]}" ] || { echo "FAIL: checksums differ across rank counts"; exit 1; }
echo "same parameters on 1, 2 and 3 ranks"

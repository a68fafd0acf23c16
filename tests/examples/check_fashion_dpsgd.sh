#!/usr/bin/env bash
# The DP-SGD example on generated images: per-example gradients (vmap of grad through the main
# example's rematerialized CNN), clipped and noised by optim::dpsgd, still train the model (test
# accuracy above 0.7 after two short epochs).
set -euo pipefail
out=$("$1" --synthetic 512 --batch 64 --epochs 2)
echo "$out"
last=$(tail -n 1 <<<"$out")
acc=$(sed -n 's/.*"test_accuracy":\([0-9.e+-]*\).*/\1/p' <<<"$last")
[ -n "$acc" ] || { echo "FAIL: no JSON result line"; exit 1; }
awk -v a="$acc" 'BEGIN { exit !(a > 0.7) }' || { echo "FAIL: test accuracy $acc is not above 0.7"; exit 1; }
echo "fashion_dpsgd learns with clipped, noised per-example gradients: test accuracy $acc"

#!/usr/bin/env bash
# The fashion_autoencoder example on generated images: the test reconstruction error at least
# halves, it writes its PGM image, and its last line is JSON.
set -euo pipefail
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
out=$("$1" --synthetic 512 --steps 80 --batch 32 --lr 0.005 --image "$dir/ae.pgm")
echo "$out"
last=$(tail -n 1 <<<"$out")
before=$(sed -n 's/.*"test_mse_before":\([0-9.e+-]*\).*/\1/p' <<<"$last")
after=$(sed -n 's/.*"test_mse_after":\([0-9.e+-]*\).*/\1/p' <<<"$last")
[ -n "$before" ] && [ -n "$after" ] || { echo "FAIL: no JSON result line"; exit 1; }
awk -v a="$before" -v b="$after" 'BEGIN { exit !(b < a * 0.5) }' || { echo "FAIL: test error $before -> $after did not halve"; exit 1; }
head -c 2 "$dir/ae.pgm" | grep -q P5 || { echo "FAIL: no PGM image"; exit 1; }
echo "fashion_autoencoder learns: test error $before -> $after"

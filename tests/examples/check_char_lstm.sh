#!/usr/bin/env bash
# The char_lstm example on a short setting: it runs, its loss falls, its last line is JSON, and
# training with remat over time (sqrt segments by default, binomial, per step) gives the very same
# losses as without remat (bitwise gradients).
set -euo pipefail
out=$("$1" --steps 40 --seq 32 --batch 16 --hidden 64 --sample 20 --lr 0.01)
echo "$out"
last=$(tail -n 1 <<<"$out")
first=$(sed -n 's/.*"first_loss":\([0-9.e+-]*\).*/\1/p' <<<"$last")
final=$(sed -n 's/.*"final_loss":\([0-9.e+-]*\).*/\1/p' <<<"$last")
[ -n "$first" ] && [ -n "$final" ] || { echo "FAIL: no JSON result line"; exit 1; }
awk -v a="$first" -v b="$final" 'BEGIN { exit !(b < a * 0.75) }' || { echo "FAIL: loss $first -> $final did not fall by a quarter"; exit 1; }
grep -q '^sample: This ' <<<"$out" || { echo "FAIL: no sample"; exit 1; }
for mode in none binomial per-step; do
  other=$("$1" --steps 40 --seq 32 --batch 16 --hidden 64 --sample 0 --lr 0.01 --remat "$mode" | tail -n 1)
  other_final=$(sed -n 's/.*"final_loss":\([0-9.e+-]*\).*/\1/p' <<<"$other")
  [ "$other_final" = "$final" ] || { echo "FAIL: --remat $mode ends at loss $other_final, the default at $final"; exit 1; }
done
echo "char_lstm learns: loss $first -> $final, the same with --remat none, binomial and per-step"

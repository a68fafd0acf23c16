#!/usr/bin/env bash
# The char_transformer example on a short setting: its loss falls, and its two samples (the whole
# text through the model for each character, and the attention decode cache) agree.
set -euo pipefail
out=$("$1" --steps 30 --seq 24 --batch 8 --dim 32 --heads 2 --layers 2 --lr 0.01)
echo "$out"
last=$(tail -n 1 <<<"$out")
first=$(sed -n 's/.*"first_loss":\([0-9.e+-]*\).*/\1/p' <<<"$last")
final=$(sed -n 's/.*"final_loss":\([0-9.e+-]*\).*/\1/p' <<<"$last")
[ -n "$first" ] && [ -n "$final" ] || { echo "FAIL: no JSON result line"; exit 1; }
awk -v a="$first" -v b="$final" 'BEGIN { exit !(b < a * 0.75) }' || { echo "FAIL: loss $first -> $final did not fall by a quarter"; exit 1; }
grep -q '"samples_agree":true' <<<"$last" || { echo "FAIL: the decode cache's sample differs"; exit 1; }
echo "char_transformer learns (loss $first -> $final) and its cached decoding agrees"

#!/usr/bin/env bash
# The physics-informed example on a short setting: the loss (which holds the network's second
# derivative with respect to its input) falls, the solution comes within 1% of sin(pi x), and the
# run with remat per block ends with bitwise the parameters of the run without remat.
set -euo pipefail
out=$("$1" --steps 150)
echo "$out"
last=$(tail -n 1 <<<"$out")
field() { sed -n "s/.*\"$1\":\"\{0,1\}\([0-9a-f.e+-]*\)\"\{0,1\}.*/\1/p" <<<"$2"; }
first=$(field first_loss "$last"); final=$(field final_loss "$last"); err=$(field relative_l2_error "$last")
sum=$(field params_checksum "$last")
[ -n "$first" ] && [ -n "$final" ] && [ -n "$err" ] || { echo "FAIL: no JSON result line"; exit 1; }
awk -v a="$first" -v b="$final" 'BEGIN { exit !(b < a / 100) }' || { echo "FAIL: loss $first -> $final did not fall 100x"; exit 1; }
awk -v e="$err" 'BEGIN { exit !(e < 0.01) }' || { echo "FAIL: relative L2 error $err against sin(pi x) is not below 1%"; exit 1; }
plain=$("$1" --steps 150 --remat none | tail -n 1)
[ "$(field params_checksum "$plain")" = "$sum" ] || { echo "FAIL: --remat none ends with other parameters"; exit 1; }
echo "poisson_pinn solves -u'' = pi^2 sin(pi x): loss $first -> $final, relative error $err, bitwise with and without remat"
# L-BFGS with its backtracking linesearch (optim::lbfgs): within 1% in 60 steps, and the same bits
# with and without remat (the linesearch's trial losses run through the checkpointed blocks too).
lb=$("$1" --steps 60 --optimizer lbfgs | tail -n 1)
lb_err=$(field relative_l2_error "$lb"); lb_final=$(field final_loss "$lb")
awk -v e="$lb_err" 'BEGIN { exit !(e < 0.01) }' || { echo "FAIL: lbfgs relative L2 error $lb_err is not below 1%"; exit 1; }
lb_plain=$("$1" --steps 60 --optimizer lbfgs --remat none | tail -n 1)
[ "$(field params_checksum "$lb_plain")" = "$(field params_checksum "$lb")" ] || { echo "FAIL: lbfgs with --remat none ends with other parameters"; exit 1; }
echo "with --optimizer lbfgs: loss $lb_final and relative error $lb_err after 60 steps, bitwise with and without remat"

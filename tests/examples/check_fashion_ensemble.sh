#!/usr/bin/env bash
# The ensemble example (one lift::vmap of MLPs) on generated images: every member learns (test
# accuracy above 0.9), the members are different models (their own init and dropout keys: their
# training losses differ), and the ensemble's mean prediction is reported.
set -euo pipefail
out=$("$1" --synthetic 2048 --epochs 1 --members 4 --hidden 64)
echo "$out"
last=$(tail -n 1 <<<"$out")
python3 - "$last" <<'PY' || exit 1
import json, sys
r = json.loads(sys.argv[1])
acc, losses = r["member_accuracies"], r["member_last_epoch_train_loss_sums"]
assert r["members"] == 4 and len(acc) == 4 and len(losses) == 4, "FAIL: four members expected"
assert min(acc) > 0.9, f"FAIL: a member did not learn: {acc}"
assert len(set(losses)) == 4, f"FAIL: members trained identically (same keys?): {losses}"
assert 0.9 < r["ensemble_accuracy"] <= 1.0, f"FAIL: ensemble accuracy {r['ensemble_accuracy']}"
print(f"fashion_ensemble: 4 members learn (accuracy {min(acc):.3f}..{max(acc):.3f}), each its own model")
PY

#!/usr/bin/env bash
# GPT-2 124M on GPT-2's vocabulary and a >= 1 GB prepared corpus, on a CPU: a few steps, killed and resumed
# (bit-exact against an uninterrupted run), evaluated on a sample of the held-out documents, sampled.
#   bash benchmarks/gpt2_124m_cpu.sh PREPARED_DIR OUT_DIR
# Batch 4 x 1024 (the preset's 480 x 1024 is a GPU's), no accumulation; everything else is gpt2_124m's.
set -euo pipefail
prepared=$1
out=$2
q=".venv/bin/qkvjax"
common=(--config experiments/configs/gpt2_124m.py "--config.data.prepared=$prepared" --config.train.batch_size=4
        --config.train.grad_accum_steps=1 --config.train.checkpoint_every=2 --config.train.log_every=1
        --config.train.eval_every=4 --config.train.eval_batches=1 --config.train.warmup_steps=2)
mkdir -p "$out"
echo "== straight: 4 steps"
$q train "${common[@]}" --workdir "$out/straight" --config.train.num_steps=4
echo "== resumed: 4 steps, killed (SIGKILL) once step 2's checkpoint is committed, then rerun"
$q train "${common[@]}" --workdir "$out/resumed" --config.train.num_steps=4 > "$out/killed.log" 2>&1 &
pid=$!
committed() {  # step 2's folder there and no orbax temporary folder beside it
  [ -d "$out/resumed/checkpoints/2" ] || return 1
  for f in "$out/resumed/checkpoints/"*tmp*; do [ -e "$f" ] && return 1; done
  return 0
}
until committed; do sleep 1; done
kill -9 $pid; wait $pid || true
tail -n 3 "$out/killed.log"
$q train "${common[@]}" --workdir "$out/resumed" --config.train.num_steps=4
echo "== the two runs' losses and final parameters"
.venv/bin/python - "$out" <<'PY'
import json, sys
import numpy as np
from qkvjax.workdir import restore_exported, exported_steps
import jax
out = sys.argv[1]
def losses(run):
    return [json.loads(l)["loss"] for l in open(f"{out}/{run}/metrics.jsonl") if '"eval"' not in l]
a, b = losses("straight"), losses("resumed")
print("losses straight", a); print("losses resumed ", b)
pa = restore_exported(f"{out}/straight", 4, None); pb = restore_exported(f"{out}/resumed", 4, None)
diff = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))
print(f"identical losses: {a == b}; max |param difference|: {diff}")
PY
echo "== eval (2 batches of windows spread over the validation documents)"
$q eval --workdir "$out/straight" --max-batches 2
echo "== sample"
$q sample --workdir "$out/straight" --prompt "static int" --num-tokens 20 --seed 0

#!/usr/bin/env bash
# Cloud TPU VM (single host or a pod slice): copy this checkout to every worker, install, and run the same
# command on all of them; jax.distributed.initialize() finds the other workers by itself (--distributed).
#   launch/tpu_vm.sh my-tpu us-central2-b --config=experiments/configs/gpt2_small.py --workdir=gs://bucket/run1
set -euo pipefail
name=${1:?TPU name}; zone=${2:?zone}; shift 2
cd "$(dirname "$0")/.."
git archive --format=tar.gz -o /tmp/qkvjax.tar.gz HEAD
gcloud compute tpus tpu-vm scp /tmp/qkvjax.tar.gz "$name":~/qkvjax.tar.gz --zone "$zone" --worker=all
args=$(printf '%q ' "$@")
gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all --command "
  set -e
  mkdir -p qkvjax && tar -xzf qkvjax.tar.gz -C qkvjax && cd qkvjax
  python3 -m venv .venv && .venv/bin/pip install -q -e . 'jax[tpu]'
  .venv/bin/qkvjax train --distributed $args
"

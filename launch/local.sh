#!/usr/bin/env bash
# N processes on this machine forming one JAX program (CPU: each process simulates DEVICES devices).
#   launch/local.sh 2 4 --config=experiments/configs/tiny.py --workdir=runs/mp --config.data.source_path=FILE
# Every process runs the same command; process 0 writes metrics, config and checkpoint metadata.
set -euo pipefail
n=${1:?number of processes}; devices=${2:?devices per process}; shift 2
port=${QKVJAX_PORT:-$((20000 + RANDOM % 20000))}
cd "$(dirname "$0")/.."
pids=()
for ((i = 0; i < n; i++)); do
  XLA_FLAGS="--xla_force_host_platform_device_count=$devices" JAX_PLATFORMS=cpu \
    "${PYTHON:-.venv/bin/python}" -m qkvjax.cli train --coordinator "127.0.0.1:$port" --num-processes "$n" --process-id "$i" \
    --cpu-collectives "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status

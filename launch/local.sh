#!/usr/bin/env bash
# N processes on this machine forming one JAX program over loopback (CPU: each process simulates DEVICES devices).
#
#   launch/local.sh [--dry-run] N DEVICES --config=experiments/configs/tiny.py --workdir=runs/mp --config.data.source_path=FILE
#
# Every process runs the same command; process 0 writes metrics, config and checkpoint metadata. The plan (one line
# per process) is printed first; --dry-run prints it and exits. Exits non-zero if any process fails; a process whose
# peer died exits within QKVJAX_TIMEOUT seconds (default 60). QKVJAX_PORT picks the coordinator port (default: a
# random free-looking one); PYTHON the interpreter (default .venv/bin/python).
set -euo pipefail
usage="usage: launch/local.sh [--dry-run] N DEVICES --config=FILE --workdir=DIR [--config.a.b=v ...]"
die() {
  echo "local.sh: error: $*" >&2
  exit 2
}
quote() {
  local out=() a
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
  done
  echo "${out[*]}"
}
dry_run=0
if [[ ${1:-} == --dry-run ]]; then
  dry_run=1
  shift
fi
[[ $# -ge 2 ]] || die "missing arguments; $usage"
n=$1 devices=$2
shift 2
[[ $n =~ ^[1-9][0-9]*$ ]] || die "N=$n; allowed: a number of processes >= 1"
[[ $devices =~ ^[1-9][0-9]*$ ]] || die "DEVICES=$devices; allowed: devices per process >= 1"
((${#devices} <= 3 && devices <= 512)) || die "DEVICES=$devices; allowed: 1..512 simulated CPU devices per process"
# Each process is a whole JAX runtime, ~0.5 GiB resident (tests/faults/soak.py: 440-543 MiB on the tiny config), so
# an N past what the memory holds would swap the machine to a halt instead of failing: refused before anything starts.
if [[ -r /proc/meminfo ]]; then
  avail_mib=$(awk '/^MemAvailable:/ {print int($2 / 1024)}' /proc/meminfo)
  most=$((avail_mib / 512 > 0 ? avail_mib / 512 : 1))
  ((${#n} <= 6 && n <= most)) || die "N=$n; allowed: 1..$most here (a JAX runtime of ~0.5 GiB each; $avail_mib MiB available)"
fi
port=${QKVJAX_PORT:-$((20000 + RANDOM % 20000))}
timeout=${QKVJAX_TIMEOUT:-60}
python=${PYTHON:-.venv/bin/python}
cd "$(dirname "$0")/.."
lines=()
for ((i = 0; i < n; i++)); do
  lines+=("$(quote env "XLA_FLAGS=--xla_force_host_platform_device_count=$devices" JAX_PLATFORMS=cpu "$python" -m qkvjax.cli \
    train --coordinator "127.0.0.1:$port" --num-processes "$n" --process-id "$i" --cpu-collectives \
    --distributed-timeout "$timeout" "$@")")
done
echo "# qkvjax: $n processes x $devices CPU devices over 127.0.0.1:$port"
printf '%s\n' "${lines[@]}"
if ((dry_run)); then
  exit 0
fi
pids=()
for line in "${lines[@]}"; do
  eval "$line" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status

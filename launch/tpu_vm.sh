#!/usr/bin/env bash
# Cloud TPU VM, one host or a pod slice: copy this checkout to every worker, install it there, and run the same
# train command on all of them. JAX finds the workers and the coordinator in the TPU VM metadata (--distributed).
#
#   launch/tpu_vm.sh [--dry-run] NAME ZONE ACCELERATOR_TYPE --config=FILE --workdir=gs://BUCKET/RUN [--config.a.b=v ...]
#
# ACCELERATOR_TYPE is the slice's type (v4-8, v4-32, v5litepod-16, v5p-64, ...): it gives the number of hosts, and a
# slice of several hosts needs a gs:// workdir (every host writes its shards there). The plan is printed first;
# --dry-run prints it and exits without touching anything. Preempted? Run the same command again: it resumes.
# Environment: QKVJAX_TIMEOUT (seconds to wait for the coordinator or a silent peer, default 300), QKVJAX_PORT
# (coordinator port, default 8482, JAX's default on TPU VMs).
set -euo pipefail
usage="usage: launch/tpu_vm.sh [--dry-run] NAME ZONE ACCELERATOR_TYPE --config=FILE --workdir=DIR [--config.a.b=v ...]"
die() {
  echo "tpu_vm.sh: error: $*" >&2
  exit 2
}

# Hosts of a slice: TensorCore-counted types (v2, v3, v4, v5p: 4 chips = 8 cores per host) and chip-counted
# types (v5litepod, v6e: up to 8 chips on one host, 4 per host in larger slices).
hosts_of() {
  local family=${1%-*} size=${1##*-}
  [[ $1 =~ ^(v2|v3|v4|v5p|v5litepod|v6e)-[0-9]+$ ]] || return 1
  case $family in
    v2 | v3 | v4 | v5p) echo $(((size + 7) / 8)) ;;
    v5litepod | v6e) if ((size <= 8)); then echo 1; else echo $((size / 4)); fi ;;
  esac
}

# One shell word per argument, quoted only where needed, so the plan reads as typed and evaluates as printed.
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
[[ $# -ge 3 ]] || die "missing arguments; $usage"
name=$1 zone=$2 type=$3
shift 3
hosts=$(hosts_of "$type") ||
  die "unknown accelerator type '$type'; allowed: v2-N, v3-N, v4-N, v5p-N, v5litepod-N, v6e-N (e.g. v4-32)"
workdir="" config=""
prev=""
for arg in "$@"; do
  case $arg in
    --workdir=*) workdir=${arg#--workdir=} ;;
    --config=*) config=${arg#--config=} ;;
  esac
  [[ $prev == --workdir ]] && workdir=$arg
  [[ $prev == --config ]] && config=$arg
  prev=$arg
done
[[ -n $config ]] || die "no --config=FILE given; $usage"
[[ -n $workdir ]] || die "no --workdir=DIR given; $usage"
if ((hosts > 1)) && [[ $workdir != gs://* ]]; then
  die "$type has $hosts hosts: --workdir=$workdir must be on Cloud Storage (gs://BUCKET/RUN) so that every host writes to it"
fi
timeout=${QKVJAX_TIMEOUT:-300}
port=${QKVJAX_PORT:-8482}
[[ $timeout =~ ^[0-9]+$ && $timeout -ge 1 ]] || die "QKVJAX_TIMEOUT=$timeout; allowed: seconds >= 1"
[[ $port =~ ^[0-9]+$ && $port -ge 1 && $port -le 65535 ]] || die "QKVJAX_PORT=$port; allowed: 1 to 65535"

cd "$(dirname "$0")/.."
# The slice gets `git archive HEAD` and runs from the repository root: a config HEAD lacks never reaches it, and
# edits not committed stay here.
git cat-file -e "HEAD:${config#./}" 2>/dev/null ||
  die "--config=$config is not a file in this checkout's HEAD (the slice gets git archive HEAD); commit it and pass its path from the repository root"
if [[ -n $(git status --porcelain --untracked-files=no) ]]; then
  echo "tpu_vm.sh: warning: uncommitted changes to tracked files stay here; the slice runs HEAD $(git rev-parse --short HEAD)" >&2
fi
tarball=/tmp/qkvjax-$name.tar.gz
remote_install="set -e; rm -rf qkvjax; mkdir qkvjax; tar -xzf qkvjax.tar.gz -C qkvjax; cd qkvjax; python3 -m venv .venv; .venv/bin/pip install -q -e \".[gcs]\" \"jax[tpu]\""
remote_train="cd qkvjax && .venv/bin/qkvjax train --distributed --distributed-timeout $timeout --coordinator-port $port $(quote "$@")"
ssh=(gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all)
plan=(
  "$(quote git archive --format=tar.gz -o "$tarball" HEAD)"
  "$(quote gcloud compute tpus tpu-vm scp "$tarball" "$name:~/qkvjax.tar.gz" --zone "$zone" --worker=all)"
  "$(quote "${ssh[@]}" --command "$remote_install")"
  "$(quote "${ssh[@]}" --command "$remote_train")"
)
echo "# qkvjax on TPU slice $name ($type, $hosts host(s), zone $zone): ${#plan[@]} steps, each on every worker"
echo "# workdir $workdir; rerun this command to resume after a preemption"
printf '%s\n' "${plan[@]}"
if ((dry_run)); then
  exit 0
fi
for step in "${plan[@]}"; do
  eval "$step"
done

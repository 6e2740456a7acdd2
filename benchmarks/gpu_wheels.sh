#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.py needs on the lent GPU machine beyond what its image has (Python 3.12,
# jax 0.11.2, flax, optax, orbax, torch, ...; no network there): TFDS, grain and array_record for `qkvjax train`'s
# data, tensorboardX for its events, and their own requirements. Downloaded here into .whl/ (git-ignored), carried
# with the call, installed there with --no-index --no-deps into a scratch folder (benchmarks/README.md, "GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
wheels=(tensorflow-datasets==4.9.10 array_record==0.8.6 grain==0.2.18 dm-tree==0.1.10 tensorflow-metadata==1.21.0
  simple-parsing==0.1.9 docstring_parser==0.18.0 termcolor==3.3.0 toml==0.10.2 immutabledict==4.3.1
  importlib_resources==7.1.0 tensorboardX==2.6.5 portpicker==1.6.0)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl "${wheels[@]}"
python3 -m pip wheel -q --no-deps -w .whl promise==2.3  # pure Python, published as a source archive only
du -sh .whl

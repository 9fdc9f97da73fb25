#!/usr/bin/env bash
# Build .carry/site: the Python packages `python -m lit_memory bench --gpu-proof` needs that the lent GPU machine
# lacks (it has torch 2.11+cu130, lightning, transformers, peft, accelerate, pyarrow, pandas, fsspec, xxhash,
# nvidia-ml-py; not jsonargparse, datasets, bitsandbytes, torchao, ruamel.yaml, pyseccomp), unpacked for its Python 3.12
# on x86-64, and trimmed to fit the 64 MiB a call may carry (bitsandbytes keeps only its CUDA 13.0 and CPU
# libraries; torchao drops its C++ extensions, which its optimizers do not use). Run it here (it needs PyPI),
# from the repository root; docs/gpu.md says how the device call carries and uses it.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-python3 -m pip}"
WHEELS=.carry/wheels
SITE=.carry/site
rm -rf .carry && mkdir -p "$WHEELS" "$SITE"
# Versions as this repository's CPU environment pins them; their own dependencies the machine has are left out.
PACKAGES=(
  "jsonargparse[signatures]==4.53.0" "docstring-parser" "typeshed-client" "importlib-resources"
  "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19"
  "bitsandbytes==0.50.2" "torchao==0.18.0" "ruamel.yaml==0.19.1"
  "pyseccomp==0.1.2"  # the sandbox's seccomp filter (ctypes over the machine's libseccomp.so.2, if it has one)
)
$PIP download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$WHEELS" "${PACKAGES[@]}"
for wheel in "$WHEELS"/*.whl; do
  python3 -m zipfile -e "$wheel" "$SITE"  # a wheel is a zip of its site-packages files (purelib/platlib)
done
rm -rf "$WHEELS" "$SITE/test"  # multiprocess ships its tests as a top-level `test` package: not ours to shadow
find "$SITE/bitsandbytes" -name 'libbitsandbytes_*.so' ! -name '*cuda130*' ! -name '*cpu*' -delete
find "$SITE/torchao" -maxdepth 1 -name '_C*.so' -delete
du -sh "$SITE"

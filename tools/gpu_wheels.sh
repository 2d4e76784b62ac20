#!/usr/bin/env bash
# Wheels the GPU machine lacks (no network there; see ../shared/gpu/README.md), into .gpu/wheels for `carry`:
# nbdev 2 and what the book's notebooks import beyond torch/transformers/triton (fastapi, uvicorn, pydantic,
# llguidance, gguf, jsonschema, matplotlib, openai). Python 3.12, x86-64 Linux. Run where PyPI is reachable;
# then tools/gpu_check.py's `book` section installs them there (pip --no-index) before running nbdev_test.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu/wheels
mkdir -p "$out"
platforms=""
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 any; do
  platforms="$platforms --platform $p"
done
python -m pip download -q --only-binary=:all: --python-version 3.12 $platforms -d "$out" \
  "nbdev==2.4.14" "execnb<0.2" "fastcore<2" fastapi uvicorn pydantic "llguidance>=1.9" "gguf>=0.10" "jsonschema>=4" \
  matplotlib openai
# what the GPU machine has already (torch's and transformers' dependencies): not carried
for pkg in numpy requests urllib3 charset_normalizer certifi idna PyYAML pyyaml packaging tqdm typing_extensions \
           httpx httpcore h11 anyio sniffio tzdata; do
  rm -f "$out/$pkg"-[0-9]*.whl
done
du -sh "$out"

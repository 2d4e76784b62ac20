#!/usr/bin/env bash
# The whole CPU comparison in one run: every mode of ours (float32, bfloat16, int8, int4) against transformers
# offline and against llama.cpp's llama-server served, at concurrency 1, 16 and 64, on the machine at hand.
# Run it on a quiet machine (nothing else busy: the figures are wall-clock throughput). About 25 minutes on 2 cores:
# offline 4/32/64 requests of 8-64 tokens at c=1/16/64 per mode (transformers once per activation dtype), served
# 4/32/64 prompts of 16-128 tokens per server; llama-server with -np 1 at c=1, -np 16 at c=16 and 64, -np 64 at 64.
# It prints each step with the time since the start. Later flags override these (argparse: the last one wins).
#
#   LLAMA_SERVER=/path/to/llama-server tools/bench_cpu.sh [OUT.json] [more flags of `python -m minivllm.bench cpu`]
#
# OUT.json defaults to nbs/results/cpu_compare.json, which 06_benchmarks reads. Without LLAMA_SERVER the llama.cpp
# part is skipped. Then refill 06's outputs:
#   TQDM_DISABLE=1 python tools/fill_outputs.py nbs/06_benchmarks.ipynb --flags slow
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-nbs/results/cpu_compare.json}"
shift || true
if [[ -n "${LLAMA_SERVER:-}" && ! -x "$LLAMA_SERVER" ]]; then
    echo "LLAMA_SERVER=$LLAMA_SERVER is not an executable file" >&2
    exit 2
fi
[[ -n "${LLAMA_SERVER:-}" ]] || echo "LLAMA_SERVER is not set: llama-server will not be measured" >&2
export TQDM_DISABLE=1
exec python -m minivllm.bench cpu \
    --modes float32 bfloat16 int8 int4 \
    --concurrency 1 16 64 \
    --offline-requests 4 32 64 --offline-tokens 8 64 \
    --serve-prompts 4 32 64 --serve-tokens 16 128 \
    --llama-runs 1:1 16:16 16:64 64:64 \
    --json "$out" "$@"

#!/usr/bin/env bash
# The GPU figures of bench/RESULTS.md in as few device calls as fit 10 minutes each.
# Here (once per session, with network): fetch the packages the device machine lacks into .whl/:
#   echo /.whl/ >> .git/info/exclude
#   for p in grain==0.2.18 array-record portpicker omegaconf==2.4.0; do python3 -m pip download --no-deps \
#     --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $p; done
# There (device `run` with carry [".whl"]): bash bench/gpu.sh mfu | mfu1b | vs_torch | overhead
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# A GPT-2 style model of ~350M parameters for the side-by-side runs (vs_torch mirrors GPT-2 style only).
GPT2_350M="model.d_model=1024 model.n_layers=24 model.n_heads=16 model.max_len=1024 data.seq_len=1024
           data.batch_size=16 train.dtype=bfloat16 train.remat=none train.attention=cudnn"
case "${1:-mfu}" in
  mfu)      python3 bench/mfu.py configs/gpt_350m.yaml --sweep --budget-s 500 --out "$out/mfu.jsonl" ;;
  mfu1b)    python3 bench/mfu.py configs/gpt_1b.yaml train.attention=cudnn --sweep --knobs remat,batch \
              --budget-s 500 --out "$out/mfu_1b.jsonl" ;;
  vs_torch) python3 bench/vs_torch.py configs/default.yaml $GPT2_350M --compile ;;
  overhead) python3 bench/overhead.py configs/default.yaml $GPT2_350M ;;
  *) echo "usage: bash bench/gpu.sh mfu|mfu1b|vs_torch|overhead" >&2; exit 2 ;;
esac

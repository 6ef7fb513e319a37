#!/usr/bin/env bash
# The GPU figures of bench/RESULTS.md in as few device calls as fit 10 minutes each.
# Here (once per session, with network): fetch the packages the device machine lacks into .whl/:
#   echo /.whl/ >> .git/info/exclude
#   for p in grain==0.2.18 array-record portpicker omegaconf==2.4.0; do python3 -m pip download --no-deps \
#     --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $p; done
# There (device `run` with carry [".whl"]): bash bench/gpu.sh mfu | mfu1b | vs_torch | overhead | checks | session
# `session` is the whole lent quarter-hour in one call (~10 minutes): cuDNN's paths against XLA's, a profile of
# gpt_350m's step, gpt_350m's and gpt_1b's MFU from remat dots (2026-11-26's best) over scan and batch, and
# PyTorch with torch.compile; each part time-boxed, every log under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
out=${OUT:-/tmp}
QUIET_RUN="checkpoint.enabled=false train.sample_len=0 train.eval_every=0 run.progress=false run.log_every=3"
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
  checks)   python3 bench/gpu_checks.py --out "$out/checks.jsonl" ;;
  session)
    python3 -c "import jax, jaxlib, flax, torch; print('jax', jax.__version__, 'flax', flax.__version__, 'torch', torch.__version__)"
    part() { local limit=$1 name=$2; shift 2; echo "== $name (at most $limit s)"; start=$SECONDS
             timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | grep -v -E "^(W|I)[0-9]{4} " || true
             echo "== $name: $((SECONDS - start)) s"; }
    part 40 checks python3 bench/gpu_checks.py --out "$out/checks.jsonl"
    part 60 profile_350m bash -c "python3 train.py configs/gpt_350m.yaml ${QUIET_RUN} train.steps=12 \
      run.profile_steps=9:11 run.dir=/tmp/prof && python3 bench/trace_top.py /tmp/prof --steps 2 --top 30 &&
      cp \$(find /tmp/prof -name perfetto_trace.json.gz) $out/trace_350m.json.gz"
    part 150 mfu_350m python3 bench/mfu.py configs/gpt_350m.yaml train.remat=dots --sweep --knobs scan,batch,flags \
      --steps 20 --budget-s 130 --out "$out/mfu.jsonl"
    part 100 mfu_1b python3 bench/mfu.py configs/gpt_1b.yaml train.remat=dots --sweep --knobs scan,batch --steps 20 \
      --budget-s 80 --out "$out/mfu.jsonl"
    part 200 vs_torch python3 bench/vs_torch.py configs/default.yaml $GPT2_350M --compile ;;
  *) echo "usage: bash bench/gpu.sh mfu|mfu1b|vs_torch|overhead|checks|session" >&2; exit 2 ;;
esac

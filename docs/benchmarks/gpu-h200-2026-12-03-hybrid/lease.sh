#!/bin/bash
# One step of the H200 lease for issue 16 (vLLM's hybrid allocator kept on), run from the
# repository root on the device machine: bash <this file> STEP. Steps, back to back while the
# machine stays up: p0 .. p4 (a vLLM part each), p5 (the last part, then vLLM installed), go
# (deps and kvharbor installed, then bench/gpu_window.py: a full-attention and a hybrid 7B shape).
set -uo pipefail
step=$1
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export PYTHONPATH=$HOME/kvh:$HOME/site
case $step in
p0|p1|p2|p3|p4|p5)  # vLLM's parts and its install: the same steps as the last lease's.
  exec bash "$(dirname "$0")/../gpu-h200-2026-12-02-early-load/lease.sh" "$step" ;;
install)  # The machine described, vLLM's deps and kvharbor installed (also the later leases' first step).
  { date -u; nvidia-smi; uname -a; nproc; free -g; df -h /dev/shm /tmp; } > $OUT/machine.txt 2>&1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site .whl/deps/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $HOME/kvh . || exit 1
  python3 -c 'import kvharbor, vllm, torch; print(kvharbor.__file__, vllm.__version__, torch.__version__)' ;;
go)
  bash "$0" install || exit 1
  # The models, configs and file tiers stay on the machine; the logs come back.
  timeout 560 python3 bench/gpu_window.py --shape 7b --tokens 32768 --window 4096 --cases ${CASES:-full-7b,hybrid-7b} \
    --out /tmp/gw 2>&1 | tee $OUT/window.log | grep -E '^\{|SUMMARY'
  mkdir -p $OUT/7b && cp /tmp/gw/*.log $OUT/7b/ ;;
*) echo "unknown step $step"; exit 2 ;;
esac

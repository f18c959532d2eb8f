#!/bin/bash
# One step of the H200 lease for the read-back-aware load planner, run from the repository root
# on the device machine: bash <this file> STEP. Steps, back to back while the machine stays up:
# p0 .. p4 (a vLLM part each), p5 (the last part, then vLLM installed), go (deps and kvharbor
# installed, then bench/gpu.py e2e: recompute, and a file-only tier read after the page cache
# was dropped, at 32,768 tokens).
set -uo pipefail
step=$1
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export PYTHONPATH=$HOME/kvh:$HOME/site
case $step in
p0|p1|p2|p3|p4|p5)  # vLLM's parts and its install: the same steps as an earlier lease's.
  exec bash "$(dirname "$0")/../gpu-h200-2026-12-02-early-load/lease.sh" "$step" ;;
go)
  { date -u; nvidia-smi; uname -a; nproc; free -g; df -h /dev/shm /tmp; } > $OUT/machine.txt 2>&1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site .whl/deps/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $HOME/kvh . || exit 1
  python3 -c 'import kvharbor, vllm, torch; print(kvharbor.__file__, vllm.__version__, torch.__version__)' || exit 1
  timeout 560 python3 bench/gpu.py e2e --modes ${MODES:-recompute,slowtier} --lengths 32768 --max-model-len 40000 \
    --model /tmp/kvh-llama31-8b --engine-timeout 270 --out $OUT 2>&1 | tee $OUT/e2e.log | grep -E '^\[|Error' ;;
*) echo "unknown step $step"; exit 2 ;;
esac

#!/bin/bash
# One step of the H200 lease for issue 9 item 5 (loads started before the model runner's input
# preparation), run from the repository root on the device machine: bash <this file> STEP.
# Steps, back to back while the machine stays up: p0 .. p4 (a vLLM part each), p5 (the last part,
# then vLLM installed), go (deps and kvharbor installed, bench/gpu.py raw and restart --phases service).
set -uo pipefail
step=$1
here=$(dirname "$0")
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export PYTHONPATH=$HOME/kvh:$HOME/site
mkdir -p $HOME/w
wheel=$HOME/w/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
case $step in
p0|p1|p2|p3|p4)
  cp .whl/vllm.part0${step#p} $HOME/w/ && ls $HOME/w ;;
p5)
  cp .whl/vllm.part05 $HOME/w/ && cat $HOME/w/vllm.part0? > $wheel && rm -f $HOME/w/vllm.part0? || exit 1
  echo "$(cat .whl/vllm.sha256 2>/dev/null || echo adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de)  $wheel" | sha256sum -c || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $HOME/site $wheel || exit 1
  echo "vllm installed" ;;
go)
  { date -u; nvidia-smi; uname -a; nproc; free -g; df -h /dev/shm /tmp; ulimit -l; } > $OUT/machine.txt 2>&1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site .whl/deps/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $HOME/kvh . || exit 1
  python3 -c 'import kvharbor, vllm, torch; print(kvharbor.__file__, vllm.__version__, torch.__version__)' || exit 1
  timeout 150 python3 bench/gpu.py raw --repeat 3 --out $OUT 2>&1 | tee $OUT/raw.log | tail -3
  timeout 420 python3 bench/gpu.py restart --phases service --model /tmp/kvh-llama31-8b --engine-timeout 240 --out $OUT \
    2>&1 | tee $OUT/restart.log | tail -14 ;;
*) echo "unknown step $step"; exit 2 ;;
esac

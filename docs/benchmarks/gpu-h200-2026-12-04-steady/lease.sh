#!/bin/bash
# One step of the H200 lease for issue 16 (a cold answer in a warm process beside the restores),
# run from the repository root on the device machine: bash <this file> STEP. Steps, back to back
# while the machine stays up: p0 .. p4 (a vLLM part each: .whl/vllm.partNN carried), last (the
# last part and .whl/vllm.sha256 carried, then vLLM installed), go (.whl/deps carried: deps and
# kvharbor installed, then bench/gpu_window.py --shape gdn for CASES at TOKENS), go9 (issue 9:
# the pinned copy rate, then bench/gpu.py restart --phases service with vLLM's block hashing
# at HASH, default xxhash). .whl/deps needs compressed-tensors 0.17.0 and loguru beside
# prepare-gpu-vllm.sh's wheels: vLLM 0.26's Qwen3-Next imports them.
set -uo pipefail
step=$1
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export PYTHONPATH=$HOME/kvh:$HOME/site
mkdir -p $HOME/w
wheel=$HOME/w/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
case $step in
p0|p1|p2|p3|p4)
  cp .whl/vllm.part0${step#p} $HOME/w/ && ls $HOME/w ;;
last)
  cp .whl/vllm.part0? $HOME/w/ && cat $HOME/w/vllm.part0? > $wheel && rm -f $HOME/w/vllm.part0? || exit 1
  echo "$(cat .whl/vllm.sha256)  $wheel" | sha256sum -c || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $HOME/site $wheel || exit 1
  echo "vllm installed" ;;
go)
  { date -u; nvidia-smi; uname -a; nproc; free -g; df -h /dev/shm /tmp; } > $OUT/machine.txt 2>&1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site .whl/deps/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $HOME/kvh . || exit 1
  python3 -c 'import kvharbor, vllm, torch; print(kvharbor.__file__, vllm.__version__, torch.__version__)' || exit 1
  work=$(mktemp -d /tmp/gw-XXXX)  # Models, configs and file tiers stay on the machine; the logs come back.
  timeout 560 python3 bench/gpu_window.py --shape gdn --tokens ${TOKENS:-32768} --cases ${CASES:-gdn} \
    --out $work 2>&1 | tee $OUT/gdn.log | grep -E '^\{|SUMMARY'
  mkdir -p $OUT/logs && cp $work/*.log $OUT/logs/ ;;
go9)
  python3 -c 'import kvharbor, vllm' 2>/dev/null || bash "$0" install9 || exit 1
  timeout 150 python3 bench/gpu.py raw --repeat 3 --out $OUT 2>&1 | tee $OUT/raw.log | tail -3
  timeout 420 python3 bench/gpu.py restart --phases service --model /tmp/kvh-llama31-8b --engine-timeout 240 \
    --hash-algo ${HASH:-xxhash} --out $OUT 2>&1 | tee $OUT/restart.log | tail -14 ;;
install9)
  { date -u; nvidia-smi; uname -a; nproc; free -g; df -h /dev/shm /tmp; } > $OUT/machine.txt 2>&1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site .whl/deps/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $HOME/kvh . || exit 1 ;;
*) echo "unknown step $step"; exit 2 ;;
esac

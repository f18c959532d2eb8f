#!/bin/bash
# One step of the H200 lease for issue 9 item 2 (saves land before the answer: bench/gpu.py sigint)
# and a re-run of the restart figures (items 5 and 6), from the repository root on the device machine:
# bash .gpu-src/docs/benchmarks/gpu-h200-2026-12-01-saves/lease.sh STEP.
# Steps, one call each: deps, part0-part3 (one vLLM wheel part per call), vllm (the last part, the
# install, then sigint), restart. Results accumulate in /root/res; each step packs its folder into $OUT.
set -uo pipefail
step=$1
R=$PWD
S=$R/.gpu-src
res=/root/res
model=/tmp/kvh-llama31-8b
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export PYTHONPATH=$HOME/kvh:$HOME/site
mkdir -p $res/$step $HOME/w
out=$res/$step
pack() { tar czf $OUT/$step.tgz -C $res $step; ls -la $OUT; }
part() { cp .whl/vllm.part0$1 $HOME/w/ && ls -la $HOME/w; }
case $step in
deps)
  { date -u; nvidia-smi; uname -a; nproc; free -g; df -h /dev/shm /tmp; ulimit -l; } > $out/machine.txt 2>&1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site .whl/deps/*.whl || exit 1
  (cd $S && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $HOME/kvh .) || exit 1
  python3 -c 'import kvharbor, torch; print(kvharbor.__file__, torch.__version__, torch.cuda.get_device_name(0))'
  pack ;;
part0|part1|part2|part3)
  part ${step#part} ;;
vllm)
  part 4
  cd $HOME/w && cat vllm.part0? > vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl && cd $R &&
  echo "$(cat .whl/vllm.sha256)  $HOME/w/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl" | sha256sum -c || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site \
    $HOME/w/vllm-0.26.0-*.whl || exit 1
  rm -f $HOME/w/vllm.part0?
  python3 -c 'import vllm; print("vllm", vllm.__version__)'
  (cd $S && timeout 520 python3 bench/gpu.py sigint --model $model --engine-timeout 300 --ram-gb 40 --out $out) 2>&1 \
    | tee $out/sigint.log | tail -12
  pack ;;
restart)
  (cd $S && timeout 580 python3 bench/gpu.py restart --model $model --engine-timeout 240 --out $out) 2>&1 | tee $out/restart.log | tail -30
  pack ;;
*) echo "unknown step $step"; exit 2 ;;
esac

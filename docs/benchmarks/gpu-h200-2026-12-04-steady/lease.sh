#!/bin/bash
# The H200 lease of 2026-12-04 for issue 16 (a cold answer in a warm process beside the
# restores: bench/gpu_window.py's steady_cold_*), run from the repository root on the device
# machine: the steps of ../gpu-h200-2026-12-03-mamba/lease.sh, back to back while the machine
# stays up: p0 .. p5 (.whl/vllm.part00 .. part05 carried, one each; .whl/vllm.sha256 with the
# last), then `CASES=gdn TOKENS=32768 bash <this file> go` (.whl/deps carried). The run named its
# last part's step `last`; it did what p5 does. .whl/deps needs compressed-tensors 0.17.0 and
# loguru beside prepare-gpu-vllm.sh's wheels (vLLM 0.26's Qwen3-Next imports them), and the vLLM
# wheel split into parts of 52 MiB (`split -b 52M -d`): with 58 MiB parts a transfer passed 64 MiB.
exec bash "$(dirname "$0")/../gpu-h200-2026-12-03-mamba/lease.sh" "$@"

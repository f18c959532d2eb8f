# The two commands of the README's quick start, and the checks CI runs.
.PHONY: setup setup-vllm setup-sglang demo test check lint wheel bench

# SGLang pins another torch than vLLM: its tests run in a venv of their own.
SGLANG_VENV ?= .venv-sglang

setup: setup-vllm setup-sglang

setup-vllm:
	bash scripts/setup.sh

setup-sglang:
	KVHARBOR_SGLANG_VENV="$(SGLANG_VENV)" bash scripts/setup-sglang.sh

# The demo runs vLLM only: it does not wait for the SGLang environment.
demo: setup-vllm
	.venv/bin/python -m kvharbor demo

# Lint and types first: they take seconds and fail fast. Then the wheel (dist/, what
# users install), then every test, one of which installs that wheel into a fresh venv;
# pytest exits non-zero on any failure and on "no tests collected" (exit code 5).
# tests/sglang then run with the SGLang venv's python (the first run leaves them out).
test: setup lint wheel
	KVHARBOR_WHEEL="$$(ls dist/kvharbor-*.whl)" .venv/bin/python -m pytest -q -ra --durations=15
	$(SGLANG_VENV)/bin/python -m pytest -q -ra --durations=5 tests/sglang

# The inner loop: lint, types and every test that starts no vLLM engine (unit, gateway,
# scenario), on two workers (pytest-xdist); `make test` stays the whole suite, and CI runs that.
check: lint
	.venv/bin/python -m pytest -q -n 2 -m "not e2e" tests/unit tests/gateway tests/scenario

# The wheel of this tree, without its dependencies: pip install 'dist/kvharbor-<version>-py3-none-any.whl[vllm]'.
wheel:
	rm -rf dist
	.venv/bin/pip wheel --no-deps -q . -w dist/

lint:
	.venv/bin/ruff check kvharbor tests bench
	.venv/bin/ruff format --check kvharbor tests bench
	.venv/bin/mypy kvharbor bench
	.venv/bin/mypy --explicit-package-bases tests
	.venv/bin/lint-imports

bench: setup
	.venv/bin/python bench/keys.py
	.venv/bin/python bench/store.py
	.venv/bin/python bench/manifest.py
	.venv/bin/python bench/ipc.py
	.venv/bin/python bench/gateway_load.py
	.venv/bin/python bench/serve.py --restart --plan --server-args "--num-gpu-blocks-override 64"
	.venv/bin/python bench/e2e.py
	.venv/bin/python bench/shared.py
	$(SGLANG_VENV)/bin/python bench/hicache.py

# The two commands of the README's quick start, and the checks CI runs.
.PHONY: setup demo test lint bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python -m kvharbor demo

# Lint and types first: they take seconds and fail fast. Then every test; pytest
# exits non-zero on any failure and on "no tests collected" (exit code 5).
test: setup lint
	.venv/bin/python -m pytest -q -ra --durations=15

lint:
	.venv/bin/ruff check kvharbor tests bench
	.venv/bin/ruff format --check kvharbor tests bench
	.venv/bin/mypy kvharbor

bench: setup
	.venv/bin/python bench/keys.py
	.venv/bin/python bench/store.py
	.venv/bin/python bench/manifest.py
	.venv/bin/python bench/ipc.py
	.venv/bin/python bench/e2e.py

"""Installs the stand-ins at interpreter start: for SGLang's own subprocesses (its scheduler),
which a test cannot reach otherwise. Only the engine test puts this folder on PYTHONPATH."""

from tests.sglang.shims.install import install

install()

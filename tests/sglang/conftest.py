"""The SGLang tests run in the SGLang venv (scripts/setup-sglang.sh), with the stand-ins of
tests/sglang/shims on the path before anything imports SGLang."""

from tests.sglang.shims.install import install

install()

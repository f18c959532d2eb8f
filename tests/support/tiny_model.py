"""The tiny random-weight model now lives in the package (`kvharbor.demo.model`): the
demo needs it too. Kept so that ``python -m tests.support.tiny_model DIR`` still works.

`sliding_window_model`: the same weights as a Mistral whose every layer attends to a
window (vLLM gives it one ``SlidingWindowSpec`` cache group): a model kvharbor cannot
serve yet, for the tests of what it then does.
"""

import json
import shutil
from pathlib import Path

from kvharbor.demo.model import MARKER, build_tiny_model, main

__all__ = ["MARKER", "build_tiny_model", "main", "sliding_window_model"]


def sliding_window_model(source: Path, path: Path, window: int) -> Path:
    """A copy of the tiny Llama at ``source`` as a Mistral with ``sliding_window`` ``window``
    (Mistral's weights are named as Llama's), at ``path``."""
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


if __name__ == "__main__":
    raise SystemExit(main())

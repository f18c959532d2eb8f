"""The tiny random-weight model now lives in the package (`kvharbor.demo.model`): the
demo needs it too. Kept so that ``python -m tests.support.tiny_model DIR`` still works.

`sliding_window_model`: the same weights as a Mistral whose every layer attends to a
window (vLLM gives it one ``SlidingWindowSpec`` cache group). `mixed_window_model`: the
same weights as a Llama whose layers alternate between full attention and a window
(Llama's ``layer_types``, as Gemma-style models have them).
"""

import json
import shutil
from pathlib import Path

from kvharbor.demo.model import MARKER, build_tiny_model, main

__all__ = ["MARKER", "build_tiny_model", "main", "mixed_window_model", "sliding_window_model"]


def sliding_window_model(source: Path, path: Path, window: int) -> Path:
    """A copy of the tiny Llama at ``source`` as a Mistral with ``sliding_window`` ``window``
    (Mistral's weights are named as Llama's), at ``path``."""
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def mixed_window_model(source: Path, path: Path, window: int) -> Path:
    """A copy of the tiny Llama at ``source`` whose even layers attend to a ``window`` and
    odd ones to everything, at ``path``."""
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    kinds = ("sliding_attention", "full_attention")
    config.update(sliding_window=window, layer_types=[kinds[i % 2] for i in range(config["num_hidden_layers"])])
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


if __name__ == "__main__":
    raise SystemExit(main())

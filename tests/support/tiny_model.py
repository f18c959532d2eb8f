"""The tiny random-weight model now lives in the package (`kvharbor.demo.model`): the
demo needs it too. Kept so that ``python -m tests.support.tiny_model DIR`` still works.

`sliding_window_model`: the same weights as a Mistral whose every layer attends to a
window (vLLM gives it one ``SlidingWindowSpec`` cache group). `mixed_window_model`: the
same weights as a Llama whose layers alternate between full attention and a window
(Llama's ``layer_types``, as Gemma-style models have them). `hybrid_model`: a tiny
random-weight Qwen3-Next, whose layers alternate between Gated DeltaNet (vLLM's
``MambaSpec`` group) and full attention.
"""

import json
import shutil
from pathlib import Path

from kvharbor.demo.model import MARKER, build_tiny_model, main

__all__ = ["MARKER", "build_tiny_model", "hybrid_model", "main", "mixed_window_model", "sliding_window_model"]

GDN_GAIN = 30.0
"""How much louder than its random initialisation `hybrid_model` makes each Gated DeltaNet
layer's output."""
GDN_A_LOG = -8.0
"""Each Gated DeltaNet head's log decay rate in `hybrid_model`: exp(-8) decays a state by
about a fifth over 440 tokens, where the random initialisation (up to exp(2.7) ~ 15) forgets
it within a few. With both, a restore that left the state out answers otherwise; without,
this tiny model's answer hardly depends on the state."""
HYBRID_TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


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


def hybrid_model(source: Path, path: Path, seed: int = 0) -> Path:
    """A tiny Qwen3-Next (4 layers: Gated DeltaNet, full attention, twice; 4 experts) with
    random weights drawn from ``seed``, and the tokenizer of the tiny Llama at ``source``,
    at ``path``. vLLM's CPU build runs it in bfloat16 with ``mamba_cache_mode="align"``."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=128, linear_value_head_dim=128, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
        layer_types=["linear_attention", "full_attention"] * 2, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(seed)
    # .to (not .float()) also sets the config's dtype, which vLLM reads; transformers types its wrapper unbound.
    model = Qwen3NextForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    with torch.no_grad():  # Loud Gated DeltaNet layers with a long memory: the answer depends on their state.
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.out_proj.weight.mul_(GDN_GAIN)
                layer.linear_attn.A_log.fill_(GDN_A_LOG)
    model.save_pretrained(path)
    for name in HYBRID_TEXT_FILES:
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path


if __name__ == "__main__":
    raise SystemExit(main())

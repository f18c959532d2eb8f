"""Build a tiny random-weight Llama model plus a locally trained tokenizer.

No model hub is needed: the demo, the end-to-end tests and the benchmark build their own model:
``transformers`` ``LlamaForCausalLM`` with random float32 weights and a WordLevel
tokenizer trained with ``tokenizers`` on generated text, saved with ``save_pretrained``
so vLLM (``LLM(model=path, ...)``) and ``AutoTokenizer`` can load it offline.

The build is deterministic for a given seed and parameters, and idempotent: a marker
file holding the parameters is written last, and a directory whose marker matches is
left as it is.

    python -m kvharbor.demo.model DIR [--layers 4 ...]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

MARKER = "kvharbor_tiny_model.json"
BUILDER_VERSION = 2

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0, 1, 2, 3
# Words the chat template emits, so chat prompts tokenize without <unk>.
RESERVED_WORDS = ["system", "user", "assistant", ":"]
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }} : {{ message['content'] }} {{ eos_token }} "
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def _params(**kw: Any) -> dict[str, Any]:
    return {"builder_version": BUILDER_VERSION, **kw}


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _make_words(n: int, rng: random.Random) -> list[str]:
    """n distinct lowercase pseudo-words built from consonant-vowel syllables."""
    consonants = "bdfghklmnprstvz"
    vowels = "aeiou"
    ordered: list[str] = list(RESERVED_WORDS[:n])
    words: set[str] = set(ordered)
    while len(ordered) < n:
        syllables = rng.randint(1, 4)
        w = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(syllables))
        if w not in words:
            words.add(w)
            ordered.append(w)
    return ordered


def _train_tokenizer(vocab: int, seed: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    n_words = vocab - len(SPECIAL_TOKENS)
    if n_words < 16:
        raise ValueError(f"vocab must be at least {len(SPECIAL_TOKENS) + 16}")
    rng = random.Random(seed)
    words = _make_words(n_words, rng)
    # Every word appears at least once, so the trained vocab is exactly `vocab` tokens;
    # a Zipf-ish skew gives the trainer realistic frequencies.
    lines = [" ".join(words[i : i + 16]) for i in range(0, n_words, 16)]
    weights = [1.0 / (i + 1) for i in range(n_words)]
    for _ in range(2000):
        lines.append(" ".join(rng.choices(words, weights=weights, k=rng.randint(5, 20))))
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins tokens with spaces
    trainer = trainers.WordLevelTrainer(vocab_size=vocab, min_frequency=1, special_tokens=list(SPECIAL_TOKENS))
    tok.train_from_iterator(lines, trainer=trainer)
    got = tok.get_vocab_size()
    if got != vocab:
        raise RuntimeError(f"tokenizer vocab {got} != requested {vocab}")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _portable_tokenizer_config(model_dir: Path) -> None:
    """transformers 5 writes tokenizer_class "TokenizersBackend", unknown to transformers 4
    (which older vLLM releases use); "PreTrainedTokenizerFast" loads in both."""
    p = model_dir / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build_tiny_model(
    path: Path,
    *,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    vocab: int = 4096,
    max_position: int = 4096,
    intermediate: int | None = None,
    seed: int = 0,
) -> Path:
    """Build (or reuse) a tiny random Llama at ``path`` and return ``path``.

    float32 weights; tokenizer with bos ``<s>`` (id 1), eos ``</s>`` (id 2),
    pad ``<pad>`` (id 3), unk ``<unk>`` (id 0), and exactly ``vocab`` tokens.
    """
    path = Path(path)
    params = _params(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        max_position=max_position,
        intermediate=intermediate if intermediate is not None else 2 * hidden,
        seed=seed,
    )
    if _read_marker(path) == params:
        return path
    if path.exists() and any(path.iterdir()) and _read_marker(path) is None:
        raise FileExistsError(f"{path} exists, is not empty and is not a tiny model")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        tokenizer = _train_tokenizer(vocab, seed)
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=params["intermediate"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_position,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            tie_word_embeddings=False,
            dtype="float32",
        )
        # Deterministic init without disturbing the caller's global RNG state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        if model.dtype != torch.float32:
            raise RuntimeError(f"expected float32 weights, got {model.dtype}")
        model.eval()
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _portable_tokenizer_config(tmp)
        (tmp / MARKER).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
        if path.exists():
            shutil.rmtree(path)
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        tmp.rename(path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--max-position", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 2 x hidden)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    out = build_tiny_model(
        a.dir,
        hidden=a.hidden,
        layers=a.layers,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        vocab=a.vocab,
        max_position=a.max_position,
        intermediate=a.intermediate,
        seed=a.seed,
    )
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

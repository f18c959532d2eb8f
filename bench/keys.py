"""Chunk-key throughput against the physical limit of the design.

A key is BLAKE2b-128 over the token bytes of its chunk (plus 32 bytes of
fingerprint digest and parent key), so no implementation of this design can
beat one BLAKE2b pass over the prompt's token bytes. This benchmark times
`chunk_keys` on a long prompt given as a Python list of ints (the form engines
hand over) beside, in the same run:

- ``blake2b``: one BLAKE2b-128 pass over the same little-endian uint32 bytes
  (the physical limit);
- ``pack``: turning the list into those bytes (the unavoidable Python-side
  cost of starting from a list);
- ``keys_from_array``: `chunk_keys` given an ``array('I')`` instead of a list,
  i.e. the hashing and chaining alone.

Figures are tokens per second, best of several repetitions (the least
disturbed run). Nothing is asserted: the target (>= 20 M tokens/s) is read off.

    .venv/bin/python bench/keys.py [--tokens 131072] [--chunk-size 256] [--json]

With ``--json`` the last line is ``{"figures": {...}, "ratios": {...}}``.
"""

from __future__ import annotations

import argparse
import array
import random
import sys
from hashlib import blake2b
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import best_seconds, emit

from kvharbor.cache.keys import KEY_BYTES, LayoutFingerprint, chunk_keys, token_bytes

TARGET_TOKENS_PER_S = 20e6
VOCAB = 128_256  # Llama-3 vocabulary: realistic token id magnitudes.


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=130_000, help="prompt length in tokens")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()

    rng = random.Random(0)
    tokens = [rng.randrange(VOCAB) for _ in range(args.tokens)]
    fingerprint = LayoutFingerprint(model_id="meta-llama/Llama-3.1-8B", chunk_size=args.chunk_size)
    digest = fingerprint.digest()
    full_tokens = len(tokens) // args.chunk_size * args.chunk_size
    packed = bytes(token_bytes(tokens[:full_tokens]))

    as_array = array.array("I", tokens)

    keys_s = best_seconds(lambda: chunk_keys(digest, args.chunk_size, tokens), args.repeats)
    blake_s = best_seconds(lambda: blake2b(packed, digest_size=KEY_BYTES).digest(), args.repeats)
    pack_s = best_seconds(lambda: token_bytes(tokens), args.repeats)
    array_s = best_seconds(lambda: chunk_keys(digest, args.chunk_size, as_array), args.repeats)

    figures = {
        "tokens": len(tokens),
        "chunk_size": args.chunk_size,
        "keys": len(tokens) // args.chunk_size,
        "keys_tokens_per_s": len(tokens) / keys_s,
        "blake2b_tokens_per_s": full_tokens / blake_s,
        "blake2b_bytes_per_s": len(packed) / blake_s,
        "pack_tokens_per_s": len(tokens) / pack_s,
        "keys_from_array_tokens_per_s": len(tokens) / array_s,
        "keys_ms_per_prompt": keys_s * 1e3,
    }
    limit = figures["blake2b_tokens_per_s"]
    ratios = {
        "keys_vs_blake2b": figures["keys_tokens_per_s"] / limit,
        "keys_from_array_vs_blake2b": figures["keys_from_array_tokens_per_s"] / limit,
        "keys_vs_target": figures["keys_tokens_per_s"] / TARGET_TOKENS_PER_S,
    }
    print(
        f"chunk keys of a {len(tokens)}-token prompt, chunk {args.chunk_size} (best of {args.repeats}); "
        "blake2b is the physical limit:"
    )
    emit(figures, ratios, args.json)


if __name__ == "__main__":
    main()

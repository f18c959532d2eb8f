"""``kvharbor keys``: print the chunk keys of a token sequence, to diagnose misses.

Two requests share cached KV only if they produce the same keys, so a miss
that should have been a hit is explained by comparing keys: feed the same
token ids with the layout the engine runs and see which chunk first differs
(keys are prefix-chained, so every key after the first difference differs
too). ``--fingerprint`` shows the layout that was hashed, in the same short
form the logs and ``status`` use.

    echo "1 2 3 ..." | kvharbor keys --chunk-size 256 --model meta-llama/Llama-3.1-8B
"""

from __future__ import annotations

import argparse
import sys

from kvharbor.cache.keys import LayoutFingerprint, chunk_keys, key_hex
from kvharbor.cli import Subparsers, add_config_argument, config_from_args
from kvharbor.ops.token_ids import parse_token_ids


def add_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "keys",
        help="print the chunk keys of token ids read on stdin",
        description="Read whitespace-separated token ids on stdin and print one hex key per "
        "full chunk, one per line. Options left out come from the config (chunk size, "
        "namespace) or the layout defaults; give the values your engine runs with.",
    )
    add_config_argument(parser)
    parser.add_argument("--chunk-size", type=int, metavar="N", help="tokens per chunk (default: engine.chunk_size)")
    parser.add_argument("--salt", metavar="S", help="the request's cache salt (default: none)")
    parser.add_argument("--namespace", metavar="NS", help="key namespace (default: engine.key_namespace)")
    parser.add_argument("--model", default="", metavar="ID", help="model id as the engine reports it")
    parser.add_argument("--revision", default="", metavar="REV", help="model revision or weights digest")
    parser.add_argument("--kv-dtype", default="auto", metavar="DTYPE", help="KV cache dtype (default: auto)")
    parser.add_argument("--tp-size", type=int, default=1, metavar="N", help="tensor-parallel size")
    parser.add_argument("--tp-rank", type=int, default=0, metavar="R", help="tensor-parallel rank")
    parser.add_argument("--pp-rank", type=int, default=0, metavar="R", help="pipeline-parallel rank")
    parser.add_argument(
        "--fragment-bytes",
        type=int,
        default=0,
        metavar="BYTES",
        help="device fragment size in bytes; 0 when values are never split",
    )
    parser.add_argument(
        "--kv-shape",
        action="append",
        default=[],
        metavar="DESC",
        help="one KV tensor descriptor, e.g. L0:2x128x256:float32 (repeat, in layer order)",
    )
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an engine-specific layout field (repeatable)",
    )
    parser.add_argument(
        "--fingerprint",
        action="store_true",
        help="also print the layout fingerprint (short form and digest) on stderr",
    )
    parser.set_defaults(run=run)


def _extra_fields(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    fields = []
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--extra takes NAME=VALUE, got {pair!r}")
        fields.append((name, value))
    return tuple(sorted(fields))


def fingerprint_from_args(args: argparse.Namespace) -> LayoutFingerprint:
    """The layout the options describe; config fills what they leave out."""
    chunk_size, namespace = args.chunk_size, args.namespace
    if chunk_size is None or namespace is None:
        engine = config_from_args(args).engine
        chunk_size = engine.chunk_size if chunk_size is None else chunk_size
        namespace = engine.key_namespace if namespace is None else namespace
    return LayoutFingerprint(
        model_id=args.model,
        chunk_size=chunk_size,
        kv_dtype=args.kv_dtype,
        model_revision=args.revision,
        kv_shapes=tuple(args.kv_shape),
        tp_size=args.tp_size,
        tp_rank=args.tp_rank,
        pp_rank=args.pp_rank,
        key_namespace=namespace,
        fragment_bytes=args.fragment_bytes,
        extra=_extra_fields(args.extra),
    )


def run(args: argparse.Namespace) -> int:
    fingerprint = fingerprint_from_args(args)
    digest = fingerprint.digest()
    if args.fingerprint:
        print(f"fingerprint: {fingerprint.short()}", file=sys.stderr)
        print(f"digest: {digest.hex()}", file=sys.stderr)
    token_ids = parse_token_ids(sys.stdin.read())
    keys = chunk_keys(digest, fingerprint.chunk_size, token_ids, salt=args.salt)
    if not keys:
        print(
            f"kvharbor: {len(token_ids)} tokens make no full chunk of {fingerprint.chunk_size}: "
            "no keys (such a prompt never hits the cache)",
            file=sys.stderr,
        )
    sys.stdout.write("".join(key_hex(key) + "\n" for key in keys))
    sys.stdout.flush()  # Inside main's BrokenPipeError handling, not at interpreter exit.
    return 0

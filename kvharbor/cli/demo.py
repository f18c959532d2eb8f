"""``kvharbor demo``: start vLLM with kvharbor, send a long prompt, restart vLLM, send it again.

    kvharbor demo [--workdir DIR] [--prompt-tokens N]

Prints each step and, at the end, the tokens restored from kvharbor and the
time-to-first-token gain. Exit status 1 if the restarted vLLM restored
nothing. Needs vLLM in the same Python environment; builds its own
random-weight model (no download).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvharbor.cli import Subparsers


def add_parser(subparsers: Subparsers) -> None:
    from kvharbor.demo.run import default_workdir

    parser = subparsers.add_parser(
        "demo",
        help="show a prompt's KV cache surviving a vLLM restart",
        description="Start vLLM's OpenAI server with KVHARBOR=1, send a long prompt, restart vLLM, send it "
        "again, and print how many tokens came back from kvharbor and the time-to-first-token gain.",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=default_workdir(),
        help="where the demo model, the kvharbor cache and the server logs go (default: %(default)s); "
        "the cache in it is emptied at start",
    )
    parser.add_argument("--prompt-tokens", type=int, default=3000, help="length of the prompt (default: %(default)s)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not 256 < args.prompt_tokens <= 8000:
        raise ValueError(f"--prompt-tokens must be above one chunk (256) and at most 8000, got {args.prompt_tokens}")
    from kvharbor.demo.run import EXIT_NO_HIT, EXIT_OK, run_demo
    from kvharbor.demo.server import ServerError

    try:
        result = run_demo(args.workdir, args.prompt_tokens)
    except ServerError as err:
        print(f"kvharbor demo: {err}")
        return EXIT_NO_HIT
    print(result.summary())
    return EXIT_OK if result.hit else EXIT_NO_HIT

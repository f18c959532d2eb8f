"""``kvharbor doctor``: why does this prompt miss? The restart checklist, for one prompt.

    kvharbor doctor --config kvharbor.yaml --prompt-file ids.json [--salt S] [--layout ID]
    kvharbor doctor --prompt "some text" --model /models/llama [--engine-log vllm.log]

Exit status: 0 when every chunk of the prompt is stored and nothing stands in the way
of a hit, 1 when a finding explains a miss (or would cause one), 2 for bad input (a
prompt file that is not token ids, an unknown layout, the config). The logic lives in
`kvharbor.ops.doctor`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from kvharbor.cli import Subparsers, add_config_argument, config_from_args

if TYPE_CHECKING:
    from kvharbor.ops.doctor import DoctorReport

EXIT_PROBLEM = 1


def add_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="say why a prompt misses the cache: where each chunk is, and what stands in the way",
        description="Compute the prompt's chunk keys for a layout the gateway registered (the config's chunk size "
        "and namespace, or --layout) and salt, ask the gateway (read-only) where each chunk is stored, and check "
        "the causes of a miss: a prompt shorter than a chunk, engine.require_cache_salt, --start-clean=1, tiers "
        "that take no writes, another layout, no engine registered.",
    )
    add_config_argument(parser)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt-file",
        type=Path,
        metavar="FILE",
        help="the prompt's token ids (a JSON list or whitespace-separated integers); with --model, its text",
    )
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt's text (needs --model)")
    parser.add_argument("--model", type=Path, metavar="DIR", help="tokenize the prompt with this model's tokenizer")
    parser.add_argument("--salt", metavar="S", help="the request's cache_salt (default: none)")
    parser.add_argument("--layout", metavar="ID", help="a registered layout's digest (or its first characters)")
    parser.add_argument("--engine-log", type=Path, metavar="FILE", help="check the engine's log for the connector")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvharbor.ops import doctor

    config = config_from_args(args)
    if args.prompt is not None and args.model is None:
        raise ValueError("--prompt TEXT needs --model DIR (its tokenizer); or give token ids with --prompt-file")
    if args.model is not None:
        text = args.prompt
        if text is None:
            try:
                text = args.prompt_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise ValueError(f"--prompt-file {args.prompt_file} cannot be read as text ({err})") from None
        token_ids = doctor.tokenize(text, args.model)
    else:
        token_ids = doctor.read_token_ids(args.prompt_file)
    report = doctor.diagnose(config, token_ids, args.salt, args.layout, args.engine_log)
    print(report.to_json() if args.json else render(report))
    return EXIT_PROBLEM if report.problems else 0


def render(report: DoctorReport) -> str:
    """The report for people: the chunks in runs of the same place, then each finding."""
    lines = []
    runs: list[tuple[int, int, list[str]]] = []
    for chunk in report.chunks:
        if runs and runs[-1][2] == chunk.tiers:
            runs[-1] = (runs[-1][0], chunk.index, chunk.tiers)
        else:
            runs.append((chunk.index, chunk.index, chunk.tiers))
    for first, last, tiers in runs:
        span = f"chunk {first}" if first == last else f"chunks {first}-{last}"
        tokens = f"tokens {first * report.chunk_size}-{(last + 1) * report.chunk_size - 1}"
        lines.append(f"{span} ({tokens}): {', '.join(tiers) if tiers else 'not stored'}")
    for finding in report.findings:
        lines.append(f"{finding.verdict.value:<8} {finding.check}: {finding.text}")
    return "\n".join(lines)

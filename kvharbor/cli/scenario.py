"""``kvharbor scenario``: replay outages against the real gateway and connector, and fuzz them.

    kvharbor scenario list [--json]
    kvharbor scenario run NAME|FILE|all [--json] [--keep DIR]
    kvharbor scenario fuzz --runs N --seed S [--json] [--save FILE]

``run`` prints each step and each expectation with pass or fail and exits 1 on
any failure; a bad scenario file exits 2 with its FILE:LINE message, before
anything runs. ``fuzz`` draws random timelines (`kvharbor.scenario.fuzz`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvharbor.cli import Subparsers

EXIT_FAILED = 1


def add_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "scenario", help="replay outage scenarios; random fault campaigns", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    views = parser.add_subparsers(dest="view", metavar="VIEW", required=True)
    listing = views.add_parser("list", help="the shipped scenarios")
    listing.add_argument(
        "--json", action="store_true", help="one JSON list: each scenario's name, symptom, replays and driver"
    )
    listing.set_defaults(run=run_list)
    running = views.add_parser("run", help="run scenarios: a shipped name, a file, or all")
    running.add_argument("target", metavar="NAME|FILE|all")
    running.add_argument("--json", action="store_true", help="one JSON document of every result")
    running.add_argument("--keep", metavar="DIR", help="run in DIR and keep its logs (one scenario)")
    running.set_defaults(run=run_run)
    fuzzing = views.add_parser("fuzz", help="random fault timelines, invariants checked after every step")
    fuzzing.add_argument("--runs", type=int, required=True, help="how many random timelines to run")
    fuzzing.add_argument(
        "--seed", type=int, required=True, help="the campaign's seed: the same seed draws the same timelines"
    )
    fuzzing.add_argument("--steps", type=int, default=8, help="actions per run (default 8)")
    fuzzing.add_argument("--json", action="store_true", help="the report as one JSON document on stdout")
    fuzzing.add_argument("--save", metavar="FILE", help="write the first failure's shrunk timeline as a scenario")
    fuzzing.set_defaults(run=run_fuzz)


def run_list(args: argparse.Namespace) -> int:
    from kvharbor.scenario.catalog import shipped
    from kvharbor.scenario.schema import load_scenario

    scenarios = [load_scenario(path) for path in shipped()]
    if args.json:
        print(
            json.dumps(
                [
                    {"name": s.name, "symptom": s.symptom, "replays": s.replays, "driver": s.setup.driver}
                    for s in scenarios
                ],
                indent=2,
            )
        )
    else:
        for s in scenarios:
            print(f"{s.name} [{s.setup.driver}]: {s.symptom}")
    return 0


def run_run(args: argparse.Namespace) -> int:
    from kvharbor.scenario.catalog import resolve
    from kvharbor.scenario.runner import run_scenario

    scenarios = resolve(args.target)  # Every file validated before any runs.
    if args.keep and len(scenarios) != 1:
        raise ValueError("--keep: give one scenario")
    results = []
    for scenario in scenarios:
        result = run_scenario(scenario, Path(args.keep) if args.keep else None)
        results.append(result)
        if not args.json:
            print("\n".join(result.lines()), flush=True)
    failed = [r.name for r in results if not r.passed]
    if args.json:
        print(json.dumps({"passed": not failed, "results": [json.loads(r.to_json()) for r in results]}, indent=2))
    elif len(results) > 1:
        print(
            f"{len(results) - len(failed)} of {len(results)} scenarios passed"
            + (f"; failed: {', '.join(failed)}" if failed else "")
        )
    return EXIT_FAILED if failed else 0


def run_fuzz(args: argparse.Namespace) -> int:
    from kvharbor.scenario.fuzz import campaign

    if args.runs <= 0:
        raise ValueError(f"--runs must be > 0 (got {args.runs})")
    if args.steps <= 0:
        raise ValueError(f"--steps must be > 0 (got {args.steps})")
    # With --json, stdout is the report alone; progress and failures go to stderr.
    out = sys.stderr if args.json else sys.stdout
    report = campaign(args.runs, args.seed, args.steps, Path(args.save) if args.save else None, out)
    if args.json:
        print(report.to_json())
    return EXIT_FAILED if report.failures else 0

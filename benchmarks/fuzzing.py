"""What the fuzzers (fuzz_prepare.py, fuzz_resume.py) share: their common flags, the scenarios of
a range of seeds run one by one (a failure printed as its one line and counted, the figures
summed, one JSON summary), and the fixed scenarios of the open bugs replayed.

The scenarios themselves live in tests/faults/ (the tests never import benchmarks/).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable, Collection, Mapping

from faults.conftest import ScenarioFailed


def add_arguments(ap: argparse.ArgumentParser, *, scenarios: int) -> None:
    """The flags every fuzzer takes: --scenarios, --seed, --work, --json, --known."""
    ap.add_argument("--scenarios", type=int, default=scenarios)
    ap.add_argument("--seed", type=int, default=0, help="the first scenario's seed")
    ap.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--known", action="store_true",
                    help="replay the fixed scenarios of the open bugs (KNOWN_FAILURES) instead")


def run_seeds(args: argparse.Namespace, check_one: Callable[[int], Mapping[str, Any]], *,
              every: int, t0: float) -> int:
    """``check_one(seed)`` for each of the args' seeds (its figures summed; a ScenarioFailed
    printed and counted), a progress line every ``every`` scenarios, then the summary printed
    (and written to --json); the exit code, the number of failures (at most 100)."""
    failures, figures = 0, {}
    for seed in range(args.seed, args.seed + args.scenarios):
        try:
            got = check_one(seed)
        except ScenarioFailed as e:
            failures += 1
            print(e, flush=True)
            continue
        for k, v in got.items():
            figures[k] = figures.get(k, 0) + v
        if (seed - args.seed + 1) % every == 0:
            print(f"{seed - args.seed + 1} scenarios, {failures} failed, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
    summary = {"scenarios": args.scenarios, "first_seed": args.seed, "failed": failures,
               "seconds": round(time.monotonic() - t0, 1), **figures}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return min(failures, 100)


def replay_known(fixed: Mapping[str, tuple[str, Any]], known_failures: Collection[str],
                 check_one: Callable[[Any], Any]) -> int:
    """``check_one(scenario)`` for the fixed scenarios of the failures still open, saying which
    passes now and which still fails; the number that fail."""
    failed = 0
    for name, (known, scn) in fixed.items():
        if known not in known_failures:
            continue
        try:
            check_one(scn)
            print(f"passes now: {name} ({known}): remove it from KNOWN_FAILURES", flush=True)
        except ScenarioFailed as e:
            failed += 1
            print(f"still fails: {name}: {e}", flush=True)
    return failed

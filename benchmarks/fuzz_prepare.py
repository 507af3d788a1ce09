"""The prepare fuzzer, longer: random corpora (txt, jsonl, jsonl.gz, csv, json array, parquet of
real text), settings (tokenizer, transform, --val-fraction, shard and unit sizes, workers, bad
records skipped) and kill -9 points chosen by the run's own progress; the finished store must be
byte-identical, every file, to an uninterrupted run's, or the rerun refused with one line.

    python benchmarks/fuzz_prepare.py --scenarios 300 --seed 0
    python benchmarks/fuzz_prepare.py --seed 17 --scenarios 1          # replay one
    python benchmarks/fuzz_prepare.py --known      # the fixed scenarios of the open bugs

tests/faults/test_prepare_fuzz.py runs seeds 0-24 of the same scenarios (faults/
prepare_scenarios.py, imported from there: the tests never import benchmarks/). The "bpe"
tokenizer is a byte-level BPE of vocab 2,000 trained here on real text, as the tests' is. Each
failure prints its scenario as one line and the command that replays it; the exit code is the
number of failures (at most 100).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import stdlib_texts  # noqa: E402
from faults.conftest import ScenarioFailed  # noqa: E402
from faults.prepare_scenarios import check, draw  # noqa: E402
from tokenmill.tokenizer import train_bpe  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0, help="the first scenario's seed")
    ap.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--known", action="store_true",
                    help="replay the fixed scenarios of the open bugs (KNOWN_FAILURES) instead")
    args = ap.parse_args(argv)
    if args.known:
        return replay_known(args)
    failures, figures, t0 = 0, {}, time.monotonic()
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        bpe = trained_bpe(work)
        for seed in range(args.seed, args.seed + args.scenarios):
            try:
                got = check(draw(seed), work, {"bytes": "bytes", "bpe": bpe},
                            replay=f"python benchmarks/fuzz_prepare.py --seed {seed} "
                                   "--scenarios 1")
            except ScenarioFailed as e:
                failures += 1
                print(e, flush=True)
                continue
            for k, v in got.items():
                figures[k] = figures.get(k, 0) + v
            if (seed - args.seed + 1) % 25 == 0:
                print(f"{seed - args.seed + 1} scenarios, {failures} failed, "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
    summary = {"scenarios": args.scenarios, "first_seed": args.seed, "failed": failures,
               "seconds": round(time.monotonic() - t0, 1), **figures}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return min(failures, 100)


def trained_bpe(work: Path) -> str:
    """The tests' BPE (vocab 2,000, trained on the same real text), in ``work``."""
    return str(train_bpe(stdlib_texts(1_500_000)[:200], 2000, out_path=work / "bpe.json"))


def replay_known(args) -> int:
    """Run the fixed scenarios of the failures still open; the number that fail."""
    from faults.prepare_scenarios import KNOWN_FAILURES
    from faults.test_prepare_fuzz import FIXED
    failed = 0
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        tokenizers = {"bytes": "bytes", "bpe": trained_bpe(Path(tmp))}
        for name, (known, scn) in FIXED.items():
            if known not in KNOWN_FAILURES:
                continue
            try:
                check(scn, Path(tmp), tokenizers, leave_out_known=False,
                      replay="python benchmarks/fuzz_prepare.py --known")
                print(f"passes now: {name} ({known}): remove it from KNOWN_FAILURES", flush=True)
            except ScenarioFailed as e:
                failed += 1
                print(f"still fails: {name}: {e}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())

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
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import fuzzing  # noqa: E402
from conftest import stdlib_texts  # noqa: E402
from faults.prepare_scenarios import check, draw  # noqa: E402
from tokenmill.tokenizer import train_bpe  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fuzzing.add_arguments(ap, scenarios=300)
    args = ap.parse_args(argv)
    if args.known:
        return replay_known(args)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        tokenizers = {"bytes": "bytes", "bpe": trained_bpe(work)}
        return fuzzing.run_seeds(args, lambda seed: check(
            draw(seed), work, tokenizers,
            replay=f"python benchmarks/fuzz_prepare.py --seed {seed} --scenarios 1"),
            every=25, t0=t0)


def trained_bpe(work: Path) -> str:
    """The tests' BPE (vocab 2,000, trained on the same real text), in ``work``."""
    return str(train_bpe(stdlib_texts(1_500_000)[:200], 2000, out_path=work / "bpe.json"))


def replay_known(args) -> int:
    """Run the fixed scenarios of the failures still open; the number that fail."""
    from faults.prepare_scenarios import KNOWN_FAILURES
    from faults.test_prepare_fuzz import FIXED
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        tokenizers = {"bytes": "bytes", "bpe": trained_bpe(Path(tmp))}
        return fuzzing.replay_known(FIXED, KNOWN_FAILURES, lambda scn: check(
            scn, Path(tmp), tokenizers, leave_out_known=False,
            replay="python benchmarks/fuzz_prepare.py --known"))


if __name__ == "__main__":
    sys.exit(main())

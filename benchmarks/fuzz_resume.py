"""The resume fuzzer, longer, and on your own stores: random runs cut into legs and resumed (another
world size, global batch, workers, a mixture edited after the checkpoint, concat or packed,
max_segments, store or streaming, up to three resumes, in-process stops or kill -9), every global
batch compared with a run that never stopped.

    python benchmarks/fuzz_resume.py --scenarios 2000 --seed 0
    python benchmarks/fuzz_resume.py --scenarios 500 --store stores/web --store stores/code \\
                                     [--text data/web ...] [--seq-len 512 --seq-len 2048]
    python benchmarks/fuzz_resume.py --seed 1234 --scenarios 1 [--kill9]      # replay one

Without --store/--text it fuzzes the small stores and text folders the test suite builds
(tests/faults/test_resume_fuzz.py runs seeds 0-199 of the same scenarios). With --store, the
named stores are the ones mixed (when they share a tokenizer) and packed layouts are cached in the
work folder, never next to your stores; --text folders are streamed with Loader.from_text
(tokenizer "bytes"). --kill9: one leg of each scenario is a training script killed with SIGKILL.
Every failure prints its scenario as one line and the command that replays it; the exit code is
the number of failures (at most 100).

The scenarios live in tests/faults/resume_scenarios.py and resume_runner.py (imported from
there: the tests never import benchmarks/).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import fuzzing  # noqa: E402
from faults.resume_runner import check  # noqa: E402
from faults.resume_scenarios import World, build_world, draw  # noqa: E402
from tokenmill.store import read_manifest  # noqa: E402


def own_world(stores: list[str], texts: list[str], seq_lens: list[int], work: Path) -> World:
    """A world of the user's stores (named s0, s1, …; mixed only if one tokenizer made them all)
    and text folders (t0, t1, …)."""
    named = {f"s{i}": str(p) for i, p in enumerate(stores)}
    tokenizers = {json.dumps(read_manifest(p)["tokenizer"], sort_keys=True)
                  for p in named.values()}
    mixable = tuple(named) if len(tokenizers) == 1 else ()
    (work / "layouts").mkdir(parents=True, exist_ok=True)
    return World(named, mixable, {f"t{i}": str(p) for i, p in enumerate(texts)},
                 tuple(seq_lens), layout_cache=str(work / "layouts"))


def replay_command(args, seed: int) -> str:
    parts = ["python", "benchmarks/fuzz_resume.py", "--seed", str(seed), "--scenarios", "1"]
    parts += [x for p in args.store for x in ("--store", p)]
    parts += [x for p in args.text for x in ("--text", p)]
    parts += [x for n in args.seq_len or [] for x in ("--seq-len", str(n))]
    return shlex.join(parts + (["--kill9"] if args.kill9 else []))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fuzzing.add_arguments(ap, scenarios=1000)
    ap.add_argument("--store", action="append", default=[], help="a store of yours (repeat)")
    ap.add_argument("--text", action="append", default=[], help="a text folder to stream (repeat)")
    ap.add_argument("--seq-len", type=int, action="append", help="seq_lens to draw from")
    ap.add_argument("--kill9", action="store_true", help="one leg a script killed with SIGKILL")
    args = ap.parse_args(argv)
    if args.known:
        return replay_known(args)
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        if args.store or args.text:
            world = own_world(args.store, args.text, args.seq_len or [128, 512], work)
        else:
            world = build_world(work / "world")
        return fuzzing.run_seeds(args, lambda seed: check(
            draw(seed, world, kill9=args.kill9), world, work, replay=replay_command(args, seed)),
            every=100, t0=time.monotonic())


def replay_known(args) -> int:
    """Run the fixed scenarios of the failures still open; the number that fail."""
    from faults.resume_scenarios import KNOWN_FAILURES
    from faults.test_resume_fuzz import FIXED
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        world = build_world(Path(tmp) / "world")
        return fuzzing.replay_known(FIXED, KNOWN_FAILURES, lambda scn: check(
            scn, world, Path(tmp), replay="python benchmarks/fuzz_resume.py --known"))


if __name__ == "__main__":
    sys.exit(main())

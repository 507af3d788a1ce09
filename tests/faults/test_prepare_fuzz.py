"""The prepare fuzzer: random corpora (txt, jsonl, jsonl.gz, csv, json array, parquet), settings
(tokenizer, transform, --val-fraction, shard and unit sizes, worker counts, bad records skipped)
and kill -9 points chosen by the run's own progress; after the reruns the store is
byte-identical, every file, to an uninterrupted run's — or, when an input or a setting changed
between the kill and the rerun, the rerun is refused with one line and ``--overwrite`` gives it.

The scenarios are in ``faults/prepare_scenarios.py`` (shared with benchmarks/fuzz_prepare.py).
"""

from __future__ import annotations

import time

import pytest

from faults.conftest import SIZE, ScenarioFailed, record
from faults.prepare_scenarios import KNOWN_FAILURES, PrepareScenario, check, draw


def test_prepare_fuzz_random_scenarios_finish_byte_identical(tmp_path, bpe_tokenizer):
    t0 = time.monotonic()
    failures, figures = [], {}
    for seed in range(SIZE.prepare_scenarios):
        try:
            got = check(draw(seed), tmp_path, {"bytes": "bytes", "bpe": bpe_tokenizer},
                        replay=f"python benchmarks/fuzz_prepare.py --seed {seed} --scenarios 1")
        except ScenarioFailed as e:
            failures.append(str(e))
            continue
        for k, v in got.items():
            figures[k] = figures.get(k, 0) + v
    record("prepare fuzz", scenarios=SIZE.prepare_scenarios, failed=len(failures),
           seconds=round(time.monotonic() - t0, 1), **figures)
    assert not failures, f"{len(failures)} of {SIZE.prepare_scenarios} scenarios failed:\n" + \
        "\n".join(failures[:10])
    assert figures["kills mid-run"] >= figures["kills"] // 2, "the kills landed after the end"


FIXED = {
    "a transform's module constant edited between kill -9 and rerun": ("transform edited",
        PrepareScenario(seed=1_000_001, files=(("jsonl", 40), ("csv", 30), ("parquet", 30)),
                        txt_mode="file", tokenizer="bytes", transform="chat", val_fraction=None,
                        shard_tokens=3000, unit_bytes=None, bad_records=False, workers=(2, 2),
                        kills=(("commit", 3),), change="transform edited")),
    "a finished store, an input rewritten under the same size and mtime, the same command": (
        # found by this fuzzer (random seed 49): "already complete", the stale store kept
        "finished store, input rewritten",
        PrepareScenario(seed=1_000_003, files=(("jsonl", 40), ("csv", 30)), txt_mode="file",
                        tokenizer="bytes", transform=None, val_fraction=None, shard_tokens=3000,
                        unit_bytes=None, bad_records=False, workers=(2, 2), kills=(("end", 0),),
                        change="input same size")),
    "a .txt paragraph dropped by a transform, a finished store met with another unit size": (
        # random seed 85: skip examples named a document by its unit's byte range
        None, draw(85)),
    "every format, --val-fraction, killed three times, the input rewritten in place": (None,
        PrepareScenario(seed=1_000_002, files=tuple((f, 25) for f in (
            "txt", "jsonl", "jsonl.gz", "csv", "json", "parquet")), txt_mode="paragraphs",
            tokenizer="bytes", transform="upper", val_fraction=0.3, shard_tokens=3000,
            unit_bytes=2000, bad_records=True, workers=(2, 1, 3, 2),
            # the last kill is due as soon as the rerun holds its kept shards: mid-run
            kills=(("workers", 0), ("commit", 9), ("commit", 2)), change="input same size")),
}


@pytest.mark.parametrize("known, scn", [  # open bugs (KNOWN_FAILURES) are not run as tests
    pytest.param(known, scn, id=name) for name, (known, scn) in FIXED.items()
    if known not in KNOWN_FAILURES])
def test_prepare_fuzz_fixed_scenario(tmp_path, bpe_tokenizer, known, scn, request):
    check(scn, tmp_path, {"bytes": "bytes", "bpe": bpe_tokenizer}, leave_out_known=False,
          replay=f"pytest 'tests/faults/test_prepare_fuzz.py::{request.node.name}'")

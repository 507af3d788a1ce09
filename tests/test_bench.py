"""tokenmill bench: every installed contender, each in its own child process, on a tiny
positional store; the table, JSON and PNG it writes; --only/--skip; missing peers skipped."""

import argparse
import contextlib
import importlib.util
import io
import json
import math
import time

import numpy as np
import pytest

from conftest import write_positional_store
from tokenmill.observe import bench
from tokenmill.base.errors import ConfigError

L, B = 32, 4
SMALL = ["--seq-len", str(L), "--batch-size", str(B), "--seconds", "0.3", "--steps", "10",
         "--step-ms", "2"]


def installed(name: str) -> bool:
    need = bench.REQUIRES.get(name)
    return need is None or importlib.util.find_spec(need) is not None


def parse(argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Token = global position: 20,000 tokens in 4 shards."""
    lengths = np.random.default_rng(5).integers(1, 300, size=120)
    lengths[-1] += 20_000 - lengths.sum()
    assert lengths[-1] > 0
    return write_positional_store(tmp_path_factory.mktemp("bench") / "store", lengths,
                                  shard_tokens=5_000)


@pytest.fixture(scope="module")
def ran(store, tmp_path_factory):
    """One bench run of every contender through the command-line entry point."""
    out = tmp_path_factory.mktemp("out")
    args = parse([str(store), *SMALL, "--json", str(out / "b.json"), "--plot", str(out / "b.png")])
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = bench.run_from_args(args)
    return code, text.getvalue(), out


def test_every_installed_contender_produced_figures(ran):
    code, _, out = ran
    assert code == 0
    report = json.loads((out / "b.json").read_text())
    results = {r["name"]: r for r in report["results"]}
    assert list(results) == list(bench.CONTENDERS)
    for name, r in results.items():
        if not installed(name):
            assert "not installed" in r["skipped"] and "tokens_per_s" not in r
            continue
        assert "error" not in r and "skipped" not in r, r
        assert r["tokens_per_s"] > 0, name
        assert 0 < r["time_to_first_batch_s"] < 60, name
        assert r["peak_rss_mb"] >= r["peak_anon_mb"] > 10, name  # an interpreter with numpy
        assert 0 <= r["data_wait_pct"] <= 100, name
        assert r["wait_p99_ms"] >= 0, name
        assert math.isfinite(r["step_slowdown_pct"]) and r["step_slowdown_pct"] > -100, name
        assert r["step_ms_alone"] > 0 and r["step_ms_with_loader"] > 0, name
    assert results["naive"]["vs_naive"] == 1.0
    assert report["settings"]["passes"] >= 1 and report["machine"]["cores"] >= 1


def test_table_json_and_png(ran):
    _, text, out = ran
    report = json.loads((out / "b.json").read_text())
    assert text.startswith("$ ") and "machine:" in text and "notes:" in text
    header = next(line for line in text.splitlines() if line.startswith("contender"))
    for column in ("tokens/s", "× naive", "1st batch", "peak RSS", "data wait", "p99 wait",
                   "step slowdown"):
        assert column in header
    for name in bench.CONTENDERS:
        assert any(line.startswith(name + " ") for line in text.splitlines()), name
    assert bench.format_table(report["results"]) in text
    if installed("torch-dataloader"):
        assert any(n.startswith("torch-dataloader: ") and "pin_memory" in n
                   for n in report["notes"])
    assert (out / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", list(bench.CONTENDERS))
def test_contenders_sample_windows_of_the_store(store, name):
    # every peer is a dev dependency: a missing one is a broken install, not a skip
    assert installed(name), f"{bench.REQUIRES[name]} not installed"
    it = bench.CONTENDERS[name](str(store), L, B, 0)
    try:
        firsts = []
        for _ in range(3):
            batch = next(it)
            x, y = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
            assert x.shape == y.shape == (B, L)
            assert (y == x + 1).all()  # targets are the inputs shifted by one token
            assert (np.diff(x, axis=1) == 1).all()  # each row is one contiguous window
            assert x.min() >= 0 and y.max() < 20_000
            firsts += x[:, 0].tolist()
        assert len(set(firsts)) > 1  # random windows, not one repeated
    finally:
        it.close()


def test_only_and_skip_select_in_registry_order():
    assert bench.select(only="nanogpt, naive") == ["naive", "nanogpt"]
    assert bench.select(skip=["grain", "torch-dataloader"]) == [
        n for n in bench.CONTENDERS if n not in ("grain", "torch-dataloader")]
    assert bench.select(only="naive,tokenmill", skip="tokenmill") == ["naive"]
    with pytest.raises(ConfigError, match="leave no contender"):
        bench.select(only="naive", skip="naive")


def test_unknown_names_are_a_clear_error_listing_the_valid_ones(store):
    for flag in ("--only", "--skip"):
        with pytest.raises(ConfigError, match=r"unknown contender 'nanogtp'.*naive, nanogpt"):
            bench.run_from_args(parse([str(store), *SMALL, flag, "naive,nanogtp"]))


def test_bad_settings_and_too_small_a_store(store):
    with pytest.raises(ConfigError, match="seq_len must be an int >= 1"):
        bench.run(store, seq_len=0, names=["naive"])
    with pytest.raises(ConfigError, match="step_ms must be a number > 0"):
        bench.run(store, step_ms=0, names=["naive"])
    with pytest.raises(ConfigError, match="too few"):
        bench.run(store, seq_len=4096, batch_size=8, names=["naive"])


def test_a_missing_peer_is_skipped_with_a_note(store, monkeypatch):
    monkeypatch.setitem(bench.REQUIRES, "nanogpt", "no_such_module_for_tokenmill")
    r = bench.measure_or_skip("nanogpt", {})
    assert r == {"skipped": "not installed (No module named 'no_such_module_for_tokenmill')"}
    notes = bench.report_notes([{"name": "nanogpt", **r}], passes=10, step_ms=2)
    assert "nanogpt: skipped, not installed (No module named" in notes[-1]
    assert "skipped" in bench.format_table([{"name": "nanogpt", **r}])


def spec_for(store, **over):
    return {"store": str(store), "seq_len": L, "batch_size": B, "seed": 0, "seconds": 0.3,
            "steps": 10, "passes": 1, **over}


def test_a_contender_that_overruns_is_stopped_and_reported(store):
    t0 = time.monotonic()
    r = bench.run_child("naive", spec_for(store, seconds=600.0), timeout=2.0)
    # a hang guard only: not stopped, the contender would run its 600 s (2 s, then close,
    # SIGTERM, SIGKILL take ~10 s at the most, and more on a busy machine)
    assert time.monotonic() - t0 < 300
    assert r["name"] == "naive" and "tokens_per_s" not in r
    assert r["error"].startswith("child process failed: timed out after 2 s"), r


def test_a_contender_that_raises_is_a_result_not_an_exception(store, tmp_path):
    r = bench.run_child("naive", spec_for(tmp_path / "no-store"), timeout=60)
    assert r["error"].startswith("StoreError: ") and "no-store" in r["error"], r


def test_slowdown_refuses_blocks_too_short_to_time_alone_steps():
    # per <= DROPPED leaves no alone step to time: say so, instead of "no median for empty data"
    import itertools

    from tokenmill.observe.bench.measure import DROPPED
    with pytest.raises(ValueError, match=rf"per must be an int > {DROPPED} \(got per={DROPPED}\)"):
        bench.slowdown(itertools.repeat(None), 1, blocks=2, per=DROPPED)
    with pytest.raises(ValueError, match=r"blocks must be an int >= 1 \(got blocks=0\)"):
        bench.slowdown(itertools.repeat(None), 1, blocks=0, per=5)
    r = bench.slowdown(itertools.repeat(None), 1, blocks=1, per=DROPPED + 1)
    assert r["step_ms_alone"] > 0


def test_a_slowdown_within_the_machines_noise_is_shown_as_noise():
    """On a busy machine bench drew "-29%" step slowdowns for peers as facts: each slowdown now
    has the spread of the step timed alone beside it, and one within that spread says noise."""
    from tokenmill.observe.bench.report import slowdown_cell
    row = {"name": "peer", "tokens_per_s": 1e6, "time_to_first_batch_s": 0.01, "peak_rss_mb": 90,
           "peak_anon_mb": 40, "data_wait_pct": 1.0, "wait_p99_ms": 0.1,
           "step_slowdown_pct": -29.04, "step_slowdown_noise_pct": 35.0}
    assert slowdown_cell(row) == "-29.0% ±35.0 noise"
    assert "-29.0% ±35.0 noise" in bench.format_table([row])
    assert slowdown_cell({**row, "step_slowdown_pct": 41.0}) == "+41.0% ±35.0"  # beyond: a cost
    import itertools
    r = bench.slowdown(itertools.repeat(None), 1, blocks=3, per=6)
    assert r["step_slowdown_noise_pct"] >= 0  # max / min of the 3 blocks' alone medians - 1
    assert bench.slowdown(itertools.repeat(None), 1, blocks=1, per=6)["step_slowdown_noise_pct"] is None

"""benchmarks/gpu.py: its CPU dry run in a real process writes every section with sane values,
and its copy-overlap arithmetic (which only a GPU's trace feeds) is exact on a made-up trace."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py"


def load_script():
    """benchmarks/gpu.py as a module (its top level imports only the stdlib and numpy)."""
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


def test_dry_run_writes_every_section(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--json",
                           str(tmp_path / "gpu.json")], env=env, capture_output=True, text=True,
                          timeout=900)  # a hang guard, not a timing threshold
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert json.loads((out / "gpu.json").read_text()) == results
    assert "data wait %" in proc.stdout and "H2D bandwidth" in proc.stdout

    facts = results["facts"]
    assert facts["mode"] == "dry-run" and facts["device"] == "cpu"
    assert facts["cpu_count"] >= 1 and facts["torch"]
    assert results["store"]["tokens"] > 0 and results["store"]["documents"] > 0

    assert set(results["train"]) == {"concat", "packed"}
    for layout, r in results["train"].items():
        assert r["same_batches"] is True, layout
        assert positive(r["ratio_tokens_per_s"]) and positive(r["ratio_synced_tokens_per_s"])
        for feed in ("naive", "to_torch"):
            x = r[feed]
            assert positive(x["tokens_per_s"]) and positive(x["step_ms_p50"]), (layout, feed)
            assert positive(x["synced_tokens_per_s"]) and positive(x["compute_ms_p50"])
            assert 0 <= x["data_wait_pct"] <= 100 and x["wait_ms_p50"] >= 0
            assert 1 <= len(x["repeats"]) <= results["setup"]["repeats"]
    assert results["train"]["packed"]["layout_stats"]["most_segments"] >= 1

    overlap = results["overlap"]
    for feed in ("naive", "to_torch"):  # no host-to-device copy on a CPU
        assert overlap[feed]["copies"] == 0 and overlap[feed]["overlap_pct"] is None

    bandwidth = results["bandwidth"]
    assert bandwidth["batch"]["bytes"] == 2 * 8 * results["setup"]["batch_size"] * \
        results["setup"]["seq_len"]  # inputs and targets, int64
    for label in ("batch", f"{results['setup']['big_mib']}MiB"):
        assert positive(bandwidth[label]["pageable_gbps"])
        assert bandwidth[label]["pinned_gbps"] is None  # pinned memory needs CUDA

    jax = results["jax"]
    assert "error" not in jax, jax
    if "skipped" not in jax:  # jax installed: the dry run ran it on jax's CPU device
        for path in ("device_put", "to_jax"):
            assert positive(jax[path]["feed_batches_per_s"])
            assert positive(jax[path]["step_batches_per_s"])
        assert positive(jax["ratio_step_batches_per_s"]) and jax["facts"]["jax"]


def test_copy_overlap_counts_copy_time_under_kernels():
    gpu = load_script()
    batch, other = 4096, 8

    def copy(ts, dur, nbytes, kind="Pinned"):
        return {"ph": "X", "cat": "gpu_memcpy", "name": f"Memcpy HtoD ({kind} -> Device)",
                "ts": ts, "dur": dur, "args": {"stream": 20, "bytes": nbytes}}

    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 10, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "gelu", "ts": 8, "dur": 4, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "adam", "ts": 30, "dur": 10, "args": {"stream": 7}},
        copy(5, 10, batch),       # 5..15: kernels 0..12 cover 7
        copy(20, 4, batch),       # 20..24: no kernel
        copy(28, 4, batch, "Pageable"),  # 28..32: kernel from 30 covers 2
        copy(0, 50, other),       # not a batch array: counted apart
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 0,
         "dur": 9, "args": {"bytes": batch}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::to", "ts": 0, "dur": 99},
    ]
    r = gpu.copy_overlap(events, {batch})
    assert (r["copies"], r["other_htod_copies"], r["kernels"]) == (3, 1, 3)
    assert (r["copy_us"], r["overlapped_us"]) == (18.0, 9.0)
    assert r["overlap_pct"] == 50.0
    assert r["copy_kinds"] == {"Memcpy HtoD (Pinned -> Device)": 2,
                               "Memcpy HtoD (Pageable -> Device)": 1}
    assert (r["copy_streams"], r["kernel_streams"]) == (["20"], ["7"])
    assert gpu.copy_overlap(events[:3], {batch})["overlap_pct"] is None  # no copies: no share

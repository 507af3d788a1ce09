"""Does a host-to-device copy on a side stream overlap kernels on this GPU, and through ``to_torch``?

The profiler's overlap figure of benchmarks/gpu.py is 0% when a training step leaves the device
idle at the moment a batch's copy is issued; this tells that apart from a device (or runtime) that
serializes copies and kernels. Two parts, on one CUDA device:

- raw: 4096² bf16 matmuls on one stream, 64 MiB pinned copies on another — wall time of each
  alone and of both issued together (together ≈ the longer one: they overlap; ≈ the sum: they do
  not), and the profiler's share of copy time during which a kernel ran;
- to_torch: ``to_torch(Loader(...), "cuda")`` feeding a loop of matmuls (~30 a batch, no
  synchronize), concat and packed: the profiler's share, as benchmarks/gpu.py computes it.

    PYTHONPATH=src python3 benchmarks/gpu_overlap.py        # prints one JSON line a part
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from gpu import copy_overlap, make_store  # noqa: E402 - benchmarks/: the same measure


def timed_ms(torch, fn) -> float:
    """Wall ms of ``fn`` between two device synchronizes."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def profiled_overlap(torch, fn) -> dict:
    """``copy_overlap`` of a torch.profiler trace of ``fn``."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    r = copy_overlap(trace["traceEvents"] if isinstance(trace, dict) else trace)
    return {k: r[k] for k in ("copies", "kernels", "copy_us", "overlap_pct")}


def main() -> None:
    """Both parts on the first CUDA device."""
    import torch
    from tokenmill import Loader
    from tokenmill.torch import to_torch
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    side, host = torch.cuda.Stream(), torch.empty(64 << 20, dtype=torch.uint8).pin_memory()

    def compute(n: int) -> None:
        for _ in range(n):
            a @ a

    def copies(n: int) -> None:
        with torch.cuda.stream(side):
            for _ in range(n):
                host.to("cuda", non_blocking=True)

    for _ in range(3):
        timed_ms(torch, lambda: (compute(20), copies(5)))
    both = lambda: (compute(200), copies(40))  # noqa: E731
    print(json.dumps({"part": "raw", "compute_ms": timed_ms(torch, lambda: compute(200)),
                      "copies_ms": timed_ms(torch, lambda: copies(40)),
                      "together_ms": timed_ms(torch, both),
                      "profiled": profiled_overlap(torch, both)}), flush=True)
    store = make_store(Path(tempfile.mkdtemp()))["path"]
    for layout in ("concat", "packed"):
        feed = to_torch(Loader(store, seq_len=1024, batch_size=16, layout=layout, seed=0,
                               dtype="int64"), device="cuda")
        batches = iter(feed)

        def steps(n: int) -> None:
            for _ in range(n):
                next(batches)["inputs"].float().sum()
                compute(30)
        steps(5)
        print(json.dumps({"part": "to_torch", "layout": layout,
                          "profiled": profiled_overlap(torch, lambda: steps(8))}), flush=True)
        feed.close()


main()

"""The host-to-device path on a real GPT training step: a plain ``.to(device)`` loop against
``tokenmill.torch.to_torch``, copy overlap, raw H2D bandwidth, and JAX ``to_jax`` against
``jax.device_put``.

    PYTHONPATH=src python3 benchmarks/gpu.py                # one CUDA GPU: the full run (budget
                                                            # 210 s: under 4 min in all)
    PYTHONPATH=src python3 benchmarks/gpu.py --dry-run      # CPU, tiny model, same code (< 60 s)

Options: ``--json PATH`` (the results are also written to ``$OUT/gpu.json`` when ``OUT`` is set;
both are rewritten after every section, so a run cut short keeps what it measured),
``--steps N``, ``--repeats N``, ``--warmup N``, ``--batch-size N``, ``--budget-s S`` (after
which no further repeat starts; default 210 s, 50 s with --dry-run). Exit status 1 when a section
failed (its entry in the JSON is ``{"error": …}``; the other sections still run).

What runs. A store made in a temporary directory from the Python standard library's ``*.py``
files (the built-in byte tokenizer: no download), read in the layouts concat and packed (packed
batches carry segment_ids, positions and loss_mask to the device with the batch: the loss uses
the mask, attention ignores the segments). A GPT written here — 8 layers, d_model 768, 12 heads,
seq_len 1024, batch 16 (--dry-run: 2 layers, d_model 64, 4 heads, seq_len 128, batch 4), bf16
autocast and fused AdamW on CUDA, fp32 and one torch thread on CPU, causal
``scaled_dot_product_attention``, no torch.compile —
trained through two feeds of the same batches (the first batch of each is checked equal):

- naive: ``next(loader)`` numpy → ``torch.from_numpy(a).to(device)``, synchronous, every step;
- to_torch: ``tokenmill.torch.to_torch(loader, device)``: pinned buffers, non-blocking copies
  on a side stream, two batches ahead.

How each figure is measured (medians over the repeats; in each repeat the feeds take turns;
each feed has its warm-up steps first):

- tokens/s and step p50: a free-running window of ``--steps`` steps, no synchronization inside
  (as a training loop runs), one device synchronize before and after: tokens ÷ wall; step p50 is
  the median interval between consecutive step ends on the host. TFLOP/s: tokens/s × the
  model's training FLOPs per token (``tokenmill.ModelCost.from_params``).
- data wait %: a second window of ``--steps`` steps, each ending in a device synchronize (as a
  loop that reads ``loss.item()`` every step), through ``tokenmill.Meter``: time inside
  ``next()`` ÷ wall. Without the synchronize a pageable copy would also wait for the GPU's
  backlog and the figure would count compute as waiting.
- copy overlap: ``torch.profiler`` (CUPTI) over a few free-running steps of each feed: of the
  time the trace's ``Memcpy HtoD`` events of the batch's arrays (by their byte size) took, the
  fraction during which some kernel ran on the device.
- H2D bandwidth: one batch, and a 64 MiB buffer, copied by ``.to(device)`` from pageable memory
  and by ``.to(device, non_blocking=True)`` from pinned memory, a device synchronize included in
  each timing: bytes ÷ median time.
- JAX, in a child process (benchmarks/gpu_jax.py: its own GPU memory,
  ``XLA_PYTHON_CLIENT_PREALLOCATE=false``; a crash there costs only this section): batches/s
  of ``tokenmill.jax.to_jax(loader, sharding)`` against ``jax.device_put(batch, sharding)`` per
  step (concat, int32), feeding alone (each batch waited for) and with a jitted MLP
  language-model step (d_model and layers as the GPT's, no attention; each loss waited for).
  Skipped, with the reason, when jax does not import or sees no GPU; with --dry-run it runs on
  jax's CPU device, so the test suite covers its code.

On a CPU (--dry-run) both torch feeds hand out tensors over the loader's own buffers (no copy:
``.to("cpu")`` returns the tensor), the profiler sees no host-to-device copy, and the bandwidth
section times a host copy (``clone``); pinned memory needs CUDA. Every figure comes from this run:
the device's name, versions and CPU counts are read here, never assumed.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # before the imports: the budget and the total count them

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from dataclasses import asdict, dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator, NamedTuple  # noqa: E402

import numpy as np  # noqa: E402

LAYOUTS = ("concat", "packed")
FEEDS = ("naive", "to_torch")


@dataclass(frozen=True)
class Setup:
    """What a run trains, on which device, and for how many steps."""

    dry_run: bool
    device: str
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    batch_size: int
    warmup: int  # steps per feed before any window (the first one compares the feeds' batches)
    steps: int  # steps per window (two windows per feed per repeat)
    repeats: int
    profile_steps: int  # free-running steps under torch.profiler per feed
    big_mib: int  # the large buffer of the bandwidth section
    copies: int  # timed copies per bandwidth figure

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


FULL = Setup(dry_run=False, device="cuda", n_layers=8, d_model=768, n_heads=12, seq_len=1024,
             batch_size=16, warmup=10, steps=60, repeats=3, profile_steps=6, big_mib=64,
             copies=30)
DRY = Setup(dry_run=True, device="cpu", n_layers=2, d_model=64, n_heads=4, seq_len=128,
            batch_size=4, warmup=2, steps=5, repeats=2, profile_steps=3, big_mib=4, copies=5)
BUDGET_S = {False: 210.0, True: 50.0}


START_OFFSET_S = [0.0]  # the JAX child adds the parent's elapsed time at its start


def say(msg: str) -> None:
    """A progress line, flushed at once (a run cut short still shows what it measured)."""
    print(f"[{time.perf_counter() - T0 + START_OFFSET_S[0]:6.1f} s] {msg}", flush=True)


class Budget:
    """Seconds left of the run's budget, counted from the script's start (imports included)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - T0)

    def short(self) -> bool:
        """True once less than 35% is left: what the later sections need, no more repeats."""
        return self.left() < 0.35 * self.seconds


# ---- facts, store, model -----------------------------------------------------------------------

def read_facts(setup: Setup) -> dict[str, Any]:
    """What this machine and its device say about themselves (nothing assumed)."""
    import torch
    import tokenmill
    from tokenmill.base.procs import usable_cores
    facts = {"mode": "dry-run" if setup.dry_run else "full", "python": platform.python_version(),
             "cpu_count": os.cpu_count(), "usable_cores": usable_cores(),
             "torch": torch.__version__, "numpy": np.__version__,
             "tokenmill": tokenmill.__version__, "tokenmill_file": tokenmill.__file__,
             "torch_threads": torch.get_num_threads(),
             "device": setup.device, "device_name": platform.processor() or platform.machine()}
    if setup.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        facts.update(device_name=torch.cuda.get_device_name(0), torch_cuda=torch.version.cuda,
                     capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                     device_memory_gib=round(props.total_memory / 2**30, 1),
                     device_count=torch.cuda.device_count())
    return facts


def make_store(root: Path) -> dict[str, Any]:
    """A store of the standard library's ``*.py`` files, one document each, byte tokenizer."""
    import tokenmill
    from tokenmill.base.io import atomic_write_bytes
    t0 = time.perf_counter()
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    lines = (json.dumps({"text": p.read_text(encoding="utf-8", errors="replace")}) for p in files)
    corpus = root / "corpus.jsonl"
    atomic_write_bytes(corpus, "".join(line + "\n" for line in lines).encode())
    manifest = tokenmill.prepare(str(corpus), out=str(root / "store"), tokenizer="bytes",
                                 progress=False)
    return {"path": str(root / "store"), "input_files": len(files),
            "documents": int(manifest["num_documents"]), "tokens": int(manifest["num_tokens"]),
            "vocab_size": int(manifest["tokenizer"]["vocab_size"]),
            "seconds": time.perf_counter() - t0}


def build_gpt(setup: Setup, vocab: int):
    """A plain decoder-only transformer (pre-norm, causal SDPA, GELU MLP) on ``setup.device``."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int, heads: int):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                       for t in self.qkv(self.ln1(x)).split(C, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            d = setup.d_model
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(setup.seq_len, d)
            self.blocks = nn.ModuleList(Block(d, setup.n_heads) for _ in range(setup.n_layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, inputs):
            pos = torch.arange(inputs.shape[1], device=inputs.device)  # made on the device
            x = self.tok(inputs) + self.pos(pos)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    return GPT().to(setup.device)


class Trainer:
    """The GPT, its AdamW and one training step on a batch dict of tensors on the device."""

    def __init__(self, setup: Setup, vocab_size: int):
        import torch
        from tokenmill import ModelCost
        self.setup, self.torch = setup, torch
        self.vocab = -(-vocab_size // 64) * 64  # rows of the embedding, padded for the GEMMs
        self.model = build_gpt(setup, self.vocab)
        cuda = setup.device == "cuda"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4,
                                     **({"fused": True} if cuda else {}))
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else \
            contextlib.nullcontext
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        compute = sum(p.numel() for m in (self.model.blocks, self.model.head)
                      for p in m.parameters())  # the embeddings are lookups, not FLOPs
        self.flops_per_token = ModelCost.from_params(
            compute, seq_len=setup.seq_len, n_layers=setup.n_layers,
            d_model=setup.d_model).flops_per_token
        self.params = sum(p.numel() for p in self.model.parameters())

    def step(self, batch: dict) -> Any:
        """Forward, loss (masked by loss_mask when the batch has one), backward, AdamW; no sync."""
        F = self.torch.nn.functional
        with self.autocast():
            logits = self.model(batch["inputs"])
        nll = F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten(),
                              reduction="none")
        if "loss_mask" in batch:
            mask = batch["loss_mask"].flatten().float()
            loss = (nll * mask).sum() / mask.sum().clamp_min(1.0)
        else:
            loss = nll.mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss

    def describe(self) -> dict[str, Any]:
        s = self.setup
        return {"n_layers": s.n_layers, "d_model": s.d_model, "n_heads": s.n_heads,
                "seq_len": s.seq_len, "batch_size": s.batch_size, "vocab_rows": self.vocab,
                "params": int(self.params), "flops_per_token": float(self.flops_per_token),
                "precision": "bf16 autocast" if s.device == "cuda" else "fp32",
                "optimizer": "AdamW (fused)" if s.device == "cuda" else "AdamW",
                "attention": "scaled_dot_product_attention, causal (segments not used)"}


# ---- the two torch feeds -------------------------------------------------------------------------

class Feed(NamedTuple):
    """One way of getting batches onto the device: its iterator, its loader, how to close it."""

    batches: Iterator[dict]
    loader: Any
    close: Callable[[], None]


def synchronous_batches(loader, device: str) -> Iterator[dict]:
    """The baseline: each batch's arrays → ``torch.from_numpy(a).to(device)``, synchronous."""
    import torch
    for arrays in loader:
        yield {k: torch.from_numpy(a).to(device) for k, a in arrays.items()}


def open_feeds(store: str, setup: Setup, layout: str) -> dict[str, Feed]:
    """Both feeds over two loaders of the same settings (hence the same batches)."""
    from tokenmill import Loader
    from tokenmill.torch import to_torch

    def loader():
        return Loader(store, seq_len=setup.seq_len, batch_size=setup.batch_size, layout=layout,
                      seed=0, dtype="int64")  # int64: what cross_entropy's targets take

    plain = loader()
    naive = synchronous_batches(plain, setup.device)
    wrapped = to_torch(loader(), device=setup.device)

    def close_naive():
        naive.close()
        plain.close()

    return {"naive": Feed(naive, plain, close_naive),
            "to_torch": Feed(iter(wrapped), wrapped.loader, wrapped.close)}


def close_feeds(feeds: dict[str, Feed]) -> None:
    for feed in feeds.values():
        feed.close()


def warm_up(trainer: Trainer, feeds: dict[str, Feed], steps: int) -> bool:
    """``steps`` steps through each feed; True if their first batches are equal, array for array."""
    torch = trainer.torch
    first = {name: next(feed.batches) for name, feed in feeds.items()}
    a, b = first["naive"], first["to_torch"]
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name, feed in feeds.items():
        trainer.step(first[name])
        for _ in range(steps - 1):
            trainer.step(next(feed.batches))
        trainer.sync()
    return bool(same)


def synced_window(trainer: Trainer, batches: Iterator[dict], steps: int) -> dict[str, float]:
    """``steps`` steps, each ending in a device synchronize, timed by tokenmill.Meter."""
    from tokenmill import Meter
    meter = Meter(batches, tokens_per_batch=trainer.setup.tokens_per_step)
    for _, batch in zip(range(steps + 1), meter):  # the Meter leaves the first next() out
        trainer.step(batch)
        trainer.sync()
    s = meter.summary()
    return {"data_wait_pct": s["data_wait_pct"], "wait_ms_p50": s["wait_p50_ms"],
            "compute_ms_p50": s["step_p50_ms"], "synced_tokens_per_s": s["tokens_per_s"]}


def free_window(trainer: Trainer, batches: Iterator[dict], steps: int) -> dict[str, float]:
    """``steps`` steps with no synchronization inside; one before and one after."""
    trainer.sync()
    t0 = time.perf_counter()
    ends = []
    for _ in range(steps):
        trainer.step(next(batches))
        ends.append(time.perf_counter())
    trainer.sync()
    wall = time.perf_counter() - t0
    tokens_per_s = steps * trainer.setup.tokens_per_step / wall
    step_s = float(np.median(np.diff([t0] + ends)))
    return {"tokens_per_s": tokens_per_s, "step_ms_p50": step_s * 1e3,
            "tflops": tokens_per_s * trainer.flops_per_token / 1e12}


def train_layout(trainer: Trainer, store: str, layout: str, budget: Budget) -> dict[str, Any]:
    """Both feeds on one layout: warm-up, then repeats of (synced window, free window) each."""
    setup = trainer.setup
    feeds = open_feeds(store, setup, layout)
    try:
        same = warm_up(trainer, feeds, setup.warmup)
        runs: dict[str, list[dict]] = {name: [] for name in feeds}
        for r in range(setup.repeats):
            if r and budget.short():
                say(f"{layout}: budget short ({budget.left():.0f} s left): stop after {r} repeats")
                break
            for name, feed in feeds.items():
                run = {**synced_window(trainer, feed.batches, setup.steps),
                       **free_window(trainer, feed.batches, setup.steps)}
                runs[name].append(run)
                say(f"{layout:6} {name:8} repeat {r + 1}/{setup.repeats}: "
                    f"{run['tokens_per_s']:,.0f} tok/s, step p50 {run['step_ms_p50']:.2f} ms, "
                    f"data wait {run['data_wait_pct']:.2f}% (synced steps)")
        result = summarize(runs, same)
        for name, feed in feeds.items():
            result[name]["loader"] = {k: v for k, v in feed.loader.stats().items()
                                      if k in ("mode", "why", "workers", "prefetch")}
        result["layout_stats"] = feeds["naive"].loader.layout_stats
        return result
    finally:
        close_feeds(feeds)


def summarize(runs: dict[str, list[dict]], same: bool) -> dict[str, Any]:
    """Per feed: the median of each figure over the repeats (and the repeats); the ratios."""
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        out[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        out[name]["repeats"] = rs
    naive, ahead = out["naive"], out["to_torch"]
    out["ratio_tokens_per_s"] = ahead["tokens_per_s"] / naive["tokens_per_s"]
    out["ratio_synced_tokens_per_s"] = ahead["synced_tokens_per_s"] / naive["synced_tokens_per_s"]
    out["same_batches"] = same
    return out


# ---- copy overlap --------------------------------------------------------------------------------

OVERLAP_METHOD = ("torch.profiler (CUPTI) over free-running steps: of the time the trace's "
                  "'Memcpy HtoD' events of the batch's arrays (matched by byte size) took, the "
                  "share during which some kernel ran on the device")


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping union of intervals.

    merged([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]
    """
    out: list[list[float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def covered(lo: float, hi: float, union: list[tuple[float, float]]) -> float:
    """Length of [lo, hi) inside a merged union of intervals.

    covered(1, 6, [(0, 2), (5, 9)]) == 2
    """
    return sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in union if a < hi and b > lo)


def copy_overlap(events: list[dict], sizes: set[int] | None = None) -> dict[str, Any]:
    """How much of the host-to-device copy time of a Chrome trace ran while a kernel ran.

    ``sizes``: count only copies of these byte sizes (a batch's arrays), when the trace gives
    bytes; the others are counted apart. Times are the trace's microseconds.
    copy_overlap([{"ph": "X", "cat": "kernel", "ts": 0, "dur": 10},
                  {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)",
                   "ts": 5, "dur": 10}])["overlap_pct"] == 50.0
    """
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    htod = [e for e in spans if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    ours = [e for e in htod if sizes is None or e.get("args", {}).get("bytes", -1) in sizes
            or "bytes" not in e.get("args", {})]
    union = merged([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels])
    copy_us = sum(float(e["dur"]) for e in ours)
    overlapped = sum(covered(float(e["ts"]), float(e["ts"]) + float(e["dur"]), union)
                     for e in ours)
    kinds: dict[str, int] = {}
    for e in ours:
        kinds[e["name"]] = kinds.get(e["name"], 0) + 1
    return {"copies": len(ours), "other_htod_copies": len(htod) - len(ours),
            "kernels": len(kernels), "copy_us": copy_us, "overlapped_us": overlapped,
            "overlap_pct": 100.0 * overlapped / copy_us if copy_us > 0 else None,
            "copy_kinds": kinds, "copy_streams": sorted({stream(e) for e in ours}),
            "kernel_streams": sorted({stream(e) for e in kernels})}


def stream(event: dict) -> str:
    """The stream (else the trace's thread id) of a device event, as text."""
    return str(event.get("args", {}).get("stream", event.get("tid", "?")))


def overlap_section(trainer: Trainer, store: str, work: Path) -> dict[str, Any]:
    """Each feed's copies under torch.profiler, concat layout: copy time concurrent with kernels."""
    from torch.profiler import ProfilerActivity, profile
    setup = trainer.setup
    cuda = setup.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out: dict[str, Any] = {"method": OVERLAP_METHOD, "layout": "concat",
                           "steps": setup.profile_steps}
    feeds = open_feeds(store, setup, "concat")
    try:
        for name, feed in feeds.items():
            batch = next(feed.batches)
            sizes = {t.numel() * t.element_size() for t in batch.values()}
            trainer.step(batch)
            trainer.step(next(feed.batches))
            trainer.sync()
            with profile(activities=activities) as prof:
                for _ in range(setup.profile_steps):
                    trainer.step(next(feed.batches))
                trainer.sync()
            path = work / f"trace-{name}.json"
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
            out[name] = copy_overlap(trace["traceEvents"] if isinstance(trace, dict) else trace,
                                     sizes)
            out[name]["exposed_copy_us_per_step"] = \
                (out[name]["copy_us"] - out[name]["overlapped_us"]) / setup.profile_steps
            if cuda and not out[name]["kernels"]:
                out[name]["note"] = "the profiler recorded no kernels (CUPTI unavailable?)"
            elif not cuda:
                out[name]["note"] = "no CUDA device: no host-to-device copies to overlap"
            shown = "n/a" if out[name]["overlap_pct"] is None else \
                f"{out[name]['overlap_pct']:.1f}%"
            say(f"overlap {name:8}: {out[name]['copies']} batch copies, {shown} concurrent with "
                f"kernels, {out[name]['copy_kinds']}")
        return out
    finally:
        close_feeds(feeds)


# ---- raw host-to-device bandwidth ----------------------------------------------------------------

def one_batch(store: str, setup: Setup) -> dict[str, np.ndarray]:
    """The first concat batch (int64, as the torch feeds take it), copied out of the loader."""
    from tokenmill import Loader
    with Loader(store, seq_len=setup.seq_len, batch_size=setup.batch_size, seed=0,
                dtype="int64") as loader:
        return {k: np.array(a) for k, a in next(iter(loader)).items()}


def median_seconds(fn: Callable[[], Any], sync: Callable[[], None], n: int) -> float:
    """Median wall time of ``fn(); sync()`` over ``n`` calls, after one untimed call."""
    fn()
    sync()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_rates(arrays: dict[str, np.ndarray], setup: Setup, sync) -> dict[str, Any]:
    """GB/s of copying ``arrays`` to the device from pageable and from pinned host memory."""
    import torch
    host = {k: torch.from_numpy(a) for k, a in arrays.items()}
    nbytes = sum(a.nbytes for a in arrays.values())
    out: dict[str, Any] = {"bytes": int(nbytes)}
    if setup.device == "cuda":
        pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
                  for k, t in host.items()}
        runs = {"pageable": lambda: [t.to("cuda") for t in host.values()],
                "pinned": lambda: [t.to("cuda", non_blocking=True) for t in pinned.values()]}
    else:  # .to("cpu") is no copy: time a host copy instead
        runs = {"pageable": lambda: [t.clone() for t in host.values()]}
        out["pinned_gbps"] = out["pinned_us"] = None
        out["note"] = "no CUDA device: a host copy (clone); pinned memory needs CUDA"
    for kind, fn in runs.items():
        s = median_seconds(fn, sync, setup.copies)
        out[f"{kind}_us"], out[f"{kind}_gbps"] = s * 1e6, nbytes / s / 1e9
    return out


def bandwidth_section(trainer: Trainer, store: str) -> dict[str, Any]:
    """Copy rates of one batch and of a large buffer, pageable against pinned."""
    setup = trainer.setup
    big = {"buffer": np.ones(setup.big_mib << 20, dtype=np.uint8)}
    out = {"method": "median wall time of the copies plus a device synchronize, "
                     f"{setup.copies} timed copies after one untimed"}
    for label, arrays in (("batch", one_batch(store, setup)), (f"{setup.big_mib}MiB", big)):
        out[label] = copy_rates(arrays, setup, trainer.sync)
        r = out[label]
        pinned = "n/a" if r["pinned_gbps"] is None else f"{r['pinned_gbps']:.2f} GB/s"
        say(f"bandwidth {label} ({r['bytes']:,} bytes): pageable {r['pageable_gbps']:.2f} GB/s, "
            f"pinned {pinned}")
    return out


# ---- JAX, in a child process ---------------------------------------------------------------------

def jax_section(setup: Setup, store: dict, work: Path, budget: Budget) -> dict[str, Any]:
    """benchmarks/gpu_jax.py in a child process (its own GPU memory); its JSON, or the error."""
    out = work / "jax.json"
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "gpu_jax.py"), store["path"],
           "--out", str(out), "--vocab", str(store["vocab_size"]),
           "--setup", json.dumps(asdict(setup)), "--elapsed", f"{time.perf_counter() - T0:.3f}"]
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if setup.dry_run:  # one thread: the CPU run is a check of the code, on a shared machine
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                            "intra_op_parallelism_threads=1").strip()
    timeout = max(30.0, budget.left())
    try:
        proc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"the JAX child ran past {timeout:.0f} s (what was left of the "
                         "budget) and was killed"}
    if proc.returncode != 0 or not out.exists():
        return {"error": f"the JAX child exited with status {proc.returncode}: "
                         f"{proc.stderr.strip()[-1500:]}"}
    return json.loads(out.read_text())


# ---- the run -------------------------------------------------------------------------------------

def jsonable(obj: Any) -> Any:
    """``obj`` with numpy scalars as Python numbers, tuples as lists (for json)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def guarded(name: str, fn: Callable[..., dict], *args) -> dict[str, Any]:
    """``fn(*args)``, or ``{"error": …}`` (traceback on stderr): the other sections still run."""
    try:
        return fn(*args)
    except Exception as e:  # a benchmark keeps what it measured; the exit status says it failed
        traceback.print_exc()
        say(f"{name}: FAILED ({type(e).__name__}: {e})")
        return {"error": f"{type(e).__name__}: {e}"}


def publish(results: dict, paths: list[Path]) -> None:
    """Write the results so far to every JSON path, atomically."""
    from tokenmill.base.io import atomic_write_json
    for path in paths:
        atomic_write_json(path, jsonable(results))


def choose_setup(args) -> Setup:
    """The dry-run or full setup, with the command line's overrides; full needs CUDA."""
    base = DRY if args.dry_run else FULL
    overrides = {k: getattr(args, k) for k in ("steps", "repeats", "warmup", "batch_size")
                 if getattr(args, k) is not None}
    for k, v in overrides.items():
        if v < 1:
            raise SystemExit(f"gpu.py: --{k.replace('_', '-')} must be >= 1 (got {v})")
    if not args.dry_run:
        import torch
        if not torch.cuda.is_available():
            raise SystemExit(f"gpu.py: no CUDA device (torch {torch.__version__}: "
                             "torch.cuda.is_available() is False); the full run needs one GPU. "
                             "Use --dry-run for the short CPU run.")
    return replace(base, **overrides)


def run(setup: Setup, budget: Budget, paths: list[Path]) -> dict[str, Any]:
    """Every section in order, the results published after each."""
    say("torch: importing")
    import torch
    if setup.dry_run:
        torch.set_num_threads(1)  # the CPU run checks the code; spinning threads on a shared
        # machine made its steps 100× slower
    results: dict[str, Any] = {"facts": read_facts(setup), "setup": asdict(setup)}
    say(f"device: {results['facts']['device_name']} · torch {results['facts']['torch']} · "
        f"{results['facts']['cpu_count']} CPUs")
    with tempfile.TemporaryDirectory(prefix="tokenmill-gpu-") as tmp:
        work = Path(tmp)
        results["store"] = store = make_store(work)
        say(f"store: {store['tokens']:,} tokens, {store['documents']} documents in "
            f"{store['seconds']:.1f} s")
        trainer = Trainer(setup, store["vocab_size"])
        results["model"] = trainer.describe()
        publish(results, paths)
        results["train"] = {}
        for layout in LAYOUTS:
            results["train"][layout] = guarded(f"train {layout}", train_layout, trainer,
                                               store["path"], layout, budget)
            publish(results, paths)
        results["overlap"] = guarded("overlap", overlap_section, trainer, store["path"], work)
        publish(results, paths)
        results["bandwidth"] = guarded("bandwidth", bandwidth_section, trainer, store["path"])
        publish(results, paths)
        del trainer
        if setup.device == "cuda":
            import torch
            torch.cuda.empty_cache()  # the JAX child allocates on the same GPU
        results["jax"] = guarded("jax", jax_section, setup, store, work, budget)
        results["total_s"] = time.perf_counter() - T0
        publish(results, paths)
    return results


def failures(results: dict[str, Any]) -> list[str]:
    """The sections that hold an error."""
    found = [f"train.{k}" for k, v in results.get("train", {}).items() if "error" in v]
    return found + [k for k in ("overlap", "bandwidth", "jax") if "error" in results.get(k, {})]


def table(results: dict[str, Any]) -> str:
    """The results as a few aligned lines of text."""
    f, m, s = results["facts"], results["model"], results["setup"]
    jax_version = results.get("jax", {}).get("facts", {}).get("jax", "-")
    lines = [f"tokenmill host-to-device benchmark ({f['mode']}) on {f['device_name']} · "
             f"torch {f['torch']} · jax {jax_version} · "
             f"{f['cpu_count']} CPUs ({f['usable_cores']} usable)",
             f"GPT {m['n_layers']} layers, d_model {m['d_model']}, {m['n_heads']} heads, seq_len "
             f"{m['seq_len']}, batch {m['batch_size']}, {m['params']:,} parameters, "
             f"{m['precision']}, {m['optimizer']}; medians of {s['repeats']} repeats × "
             f"{s['steps']} steps after {s['warmup']} warm-up steps",
             f"{'layout':7} {'feed':9} {'tokens/s':>11} {'step p50 ms':>12} {'TFLOP/s':>8} "
             f"{'data wait %':>12} {'wait p50 ms':>12} {'vs naive':>9}"]
    for layout, r in results.get("train", {}).items():
        if "error" in r:
            lines.append(f"{layout:7} error: {r['error']}")
            continue
        for feed in FEEDS:
            x = r[feed]
            ratio = f"{r['ratio_tokens_per_s']:.3f}×" if feed == "to_torch" else ""
            lines.append(f"{layout:7} {feed:9} {x['tokens_per_s']:11,.0f} {x['step_ms_p50']:12.2f} "
                         f"{x['tflops']:8.1f} {x['data_wait_pct']:12.2f} {x['wait_ms_p50']:12.3f} "
                         f"{ratio:>9}")
    lines += overlap_lines(results.get("overlap", {}))
    lines += bandwidth_lines(results.get("bandwidth", {})) + jax_lines(results.get("jax", {}))
    lines.append(f"total {results.get('total_s', 0):.1f} s (imports and store included)")
    return "\n".join(lines)


def overlap_lines(r: dict) -> list[str]:
    if "error" in r:
        return [f"copy overlap: error: {r['error']}"]
    parts = []
    for feed in FEEDS:
        if feed in r:
            x = r[feed]
            pct = "n/a" if x["overlap_pct"] is None else f"{x['overlap_pct']:.1f}%"
            parts.append(f"{feed} {pct} of {x['copies']} copies ({x['copy_us']:.0f} µs, exposed "
                         f"{x['exposed_copy_us_per_step']:.1f} µs/step)")
    return [f"copy overlap with kernels ({r.get('steps')} profiled steps): " + "; ".join(parts)]


def bandwidth_lines(r: dict) -> list[str]:
    if "error" in r:
        return [f"H2D bandwidth: error: {r['error']}"]
    out = []
    for label, x in r.items():
        if isinstance(x, dict):
            pinned = "n/a" if x["pinned_gbps"] is None else f"{x['pinned_gbps']:.2f} GB/s"
            out.append(f"H2D bandwidth, {label} ({x['bytes']:,} bytes): pageable "
                       f"{x['pageable_gbps']:.2f} GB/s, pinned {pinned}")
    return out


def jax_lines(r: dict) -> list[str]:
    if "error" in r:
        return [f"JAX: error: {r['error'][-300:]}"]
    if "skipped" in r:
        return [f"JAX: skipped: {r['skipped']}"]
    if not r:
        return []
    a, b = r["device_put"], r["to_jax"]
    return [f"JAX on {r['facts']['device_kind']}: feed {a['feed_batches_per_s']:,.1f} → "
            f"{b['feed_batches_per_s']:,.1f} batches/s ({r['ratio_feed_batches_per_s']:.3f}×), "
            f"step {a['step_batches_per_s']:,.1f} → {b['step_batches_per_s']:,.1f} batches/s "
            f"({r['ratio_step_batches_per_s']:.3f}×) (device_put → to_jax)"]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, a few steps")
    ap.add_argument("--json", type=Path, help="write the results here (also $OUT/gpu.json)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--budget-s", type=float)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import tokenmill  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"gpu.py: tokenmill does not import ({e}); run it from the repository "
                         "root as PYTHONPATH=src python3 benchmarks/gpu.py, or install tokenmill")
    setup = choose_setup(args)
    budget = Budget(args.budget_s or BUDGET_S[setup.dry_run])
    paths = [p for p in (args.json, os.environ.get("OUT") and Path(os.environ["OUT"]) / "gpu.json")
             if p]
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
    results = run(setup, budget, paths)
    print(table(results), flush=True)
    if paths:
        print("results: " + ", ".join(map(str, paths)), flush=True)
    failed = failures(results)
    if failed:
        print(f"FAILED sections: {', '.join(failed)}", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

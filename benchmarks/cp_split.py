"""Context parallelism through the Loader: the attention work of each CP rank under three splits of
the same packed batches, and what ``cpsplit.cp_batch`` costs on the host (issue 25).

The batches are a ``Loader(store, layout="packed", seq_len=…, batch_size=…)``'s, ``--steps`` of
them. A CP rank's work is the (query, key) pairs causal document-masked attention computes for its
queries: Σ (position in its attention sequence + 1) over its tokens (a row's padding joins the
sequence before it, as ``attention`` has it) — what FlexAttention's mask keeps and what the varlen
kernel computes for ``cp_batch``'s chunks. Splits of each row into ``cp`` shares:

- ``contiguous``: CP rank r takes columns [r·L/cp, (r+1)·L/cp) of every row;
- ``row head–tail``: the row cut into 2·cp chunks as one sequence, rank r takes chunks r and
  2cp−1−r (the load balancer that ignores documents);
- ``document head–tail``: every document cut so (``cp_batch``).

Per step, max / mean of the CP ranks' work (each the sum over the batch's rows); the median and
99th percentile over the steps. Then the median milliseconds of one ``cp_batch`` call.

    PYTHONPATH=src python benchmarks/cp_split.py --store /tmp/realstore --seq-len 8192 \\
        --batch 4 --cp 2,4,8 --steps 500
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tokenmill import Loader
from tokenmill.load.attention import flat_position_ids
from tokenmill.load.balance import imbalance
from tokenmill.load.cpsplit import cp_batch


def split_work(pairs: np.ndarray, cp: int) -> dict[str, list[float]]:
    """Each CP rank's work under the contiguous and the row head–tail split, (B, L) ``pairs``
    (a token's pairs) summed over rows."""
    b, length = pairs.shape
    cols = np.arange(length)
    contiguous = cols * cp // length
    chunk = cols * 2 * cp // length
    headtail = np.minimum(chunk, 2 * cp - 1 - chunk)
    return {name: [float(pairs[:, owner == r].sum()) for r in range(cp)]
            for name, owner in (("contiguous", contiguous), ("row head–tail", headtail))}


def measure(args, cp: int) -> dict:
    """Per step, max/mean over the CP ranks for each split; cp_batch milliseconds."""
    out: dict[str, list[float]] = {"contiguous": [], "row head–tail": [],
                                   "document head–tail": []}
    took = []
    with Loader(args.store, seq_len=args.seq_len, batch_size=args.batch, layout="packed",
                seed=0, num_workers=0) as loader:
        for _, batch in zip(range(args.steps), loader):
            pairs = flat_position_ids(batch["segment_ids"]) + 1
            for name, work in split_work(pairs, cp).items():
                out[name].append(imbalance(work))
            flat, work = pairs.reshape(-1), []
            for r in range(cp):
                t = time.perf_counter()
                share = cp_batch(batch, cp=cp, cp_rank=r)
                took.append(time.perf_counter() - t)
                work.append(float(flat[share.index[share.index >= 0]].sum()))
            out["document head–tail"].append(imbalance(work))
    res = {k: (float(np.median(v)), float(np.percentile(v, 99))) for k, v in out.items()}
    res["ms"] = statistics.median(took) * 1e3
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--cp", default="2,4,8")
    ap.add_argument("--steps", type=int, default=500)
    args = ap.parse_args(argv)
    print(f"store {args.store}, seq_len {args.seq_len:,}, batch {args.batch}, {args.steps} steps; "
          "max / mean of the CP ranks' work, median / p99 over the steps")
    print("| cp | contiguous | row head–tail | document head–tail (`cp_batch`) | `cp_batch` ms |")
    print("|---:|---|---|---|---:|")
    for cp in (int(x) for x in args.cp.split(",")):
        r = measure(args, cp)
        cells = " | ".join(f"{r[k][0]:.3f} / {r[k][1]:.3f}" for k in
                           ("contiguous", "row head–tail", "document head–tail"))
        print(f"| {cp} | {cells} | {r['ms']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

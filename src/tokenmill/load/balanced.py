"""Balanced batches from a plan (issue 25): every rank takes its share of the global batch dealt
by cost (``balance.balance_rows``), so the ranks do near-equal attention work each step.

A row's cost needs only the lengths of the documents in it, and those come from the plan's row
layout — a packed window's segments, or (concat with ``document_masks``) the store's document
index — never from tokens: a rank reads the tokens of the rows it fills and no others. Every rank
computes the same deal of the same global batch, a pure function of (stores, layout, seed, step,
world size), so the union of the ranks' rows is the plan-order global batch's, each row once, and
exact and elastic resume hold as for the plan order::

    balanced_positions(plan, 64, batch_size=4, rank=1, world_size=8, model=CostModel())
    # 4 of the global positions 64 … 95, ascending: rank 1's rows of balance_rows(costs, world=8)

A rank's rows stay in global order (ascending positions: the plan's fast paths copy them as
they do the plan-order rows). With ``microbatches=m`` (m > 1) a rank's rows — the same set — come
in m runs of B/m, each run ascending, dealt by cost (``balance.microbatch_rows``) so every
(rank, microbatch) does near-equal work: rows [0, B/m) of a rank's batch are microbatch 0.

With ``stratify=True`` the global batch is not the plan-order rows at its positions but the rows
a *stratified order* deals there: an epoch's rows are cut in blocks of STRATA_ROWS to
2·STRATA_ROWS − 1, and each block's rows are dealt to its positions by cost
(``balance.stratified_order``, offset by a hash of (seed, epoch, block)), so every global batch,
whatever its size, holds a cost mix like the block's that the per-step deal can balance. It is a
bijection on each block: every row of an epoch once, and a pure function of (stores, layout,
seed, epoch, block): exact resume at any step and on any world size or batch size. One block's
costs are read once from the layout (O(rows of the block)) and kept for its steps.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import Any, Mapping, NamedTuple

import numpy as np
import xxhash

from tokenmill.load.balance import CostModel, balance_rows, cost_model_of, imbalance, \
    microbatch_rows, rank_costs, row_costs, stratified_order
from tokenmill.base.errors import ConfigError, check_int
from tokenmill.load.cuts import row_parts
from tokenmill.load.plan import BatchPlan, LayoutConfig, global_positions
from tokenmill.load.sampler import hash_ints

__all__ = ["Balancing", "Deal", "STRATA_ROWS", "Stratum", "balance_of", "balanced_fingerprint",
           "balanced_positions", "deal", "described", "in_microbatches", "recorded", "row_lengths",
           "step_balance", "strata_block", "stratified_rows", "stratum"]

STRATA_ROWS = 4096  # rows a stratified block aims at: ≫ a global batch, O(1) in the store's size
STRATIFY = "golden-v1"  # goes into the fingerprint when stratify is on: batches change with it
CACHED_STRATA = 4  # blocks a plan keeps (a global batch may straddle two)
_TAG = 0x73747274  # "strt"
_STRATA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # plan → its last blocks
_STRATA_LOCK = threading.Lock()


class Balancing(NamedTuple):
    """A balanced Loader's settings: the cost model, and the microbatches a rank's rows come in."""

    model: CostModel
    micro: int = 1
    stratify: bool = False  # global batches made of stratified rows (``stratified_rows``)


class Deal(NamedTuple):
    """One step's deal: the cost of each row of the global batch (plan order), and each rank's
    row indices into it."""

    costs: np.ndarray  # float64 (B·W,)
    rows: np.ndarray  # int64 (W, B), each rank's ascending
    positions: np.ndarray  # int64 (B·W,): the plan position of each row of the global batch


def balance_of(options: Any, config: LayoutConfig, batch_size: Any = None,
               source: Any = None) -> Balancing | None:
    """A Loader's ``balance`` option (its ``LoaderOptions``) checked against its layout: None
    (off), "attention" or a CostModel, for rows that hold documents (packed, or concat with
    document_masks); with ``microbatches`` > 1, which must divide ``batch_size``; ``stratify``
    with balance on, one store."""
    balance, microbatches = options.balance, options.microbatches
    model = cost_model_of(balance)
    if model is not None and config.layout != "packed" and not config.document_masks:
        raise ConfigError(f"balance={balance!r} needs rows whose documents are known: "
                          "layout='packed', or layout='concat' with document_masks=True (got "
                          f"layout={config.layout!r}); a concat window without document masks "
                          "attends across all of it, so every row costs the same")
    if microbatches > 1 and model is None:
        raise ConfigError(f"microbatches={microbatches} orders a rank's rows by the cost of a "
                          "balanced deal: give balance='attention' (or a CostModel) too, or drop "
                          "microbatches")
    if microbatches > 1 and check_int("batch_size", batch_size, minimum=1) % microbatches:
        raise ConfigError(f"batch_size={batch_size} is not a multiple of microbatches="
                          f"{microbatches}: each microbatch takes batch_size / microbatches rows; "
                          f"make batch_size a multiple of {microbatches} or change microbatches")
    if options.stratify and (model is None or isinstance(source, Mapping) or
                             options.mixture is not None):
        got = "a mixture of stores" if model else "no balance"
        raise ConfigError("stratify=True orders one store's rows by the cost of a balanced deal: "
                          "give balance='attention' (or a CostModel) and a single store (got "
                          f"balance={balance!r}, {got}); or drop stratify")
    return None if model is None else Balancing(model, microbatches, bool(options.stratify))


def described(model: CostModel | None) -> list[float] | None:
    """The cost model as the state records it, [a, b] (None: balance off)."""
    return None if model is None else [float(model.a), float(model.b)]


def recorded(balance: Balancing | None) -> dict[str, Any]:
    """What a Loader's stream record holds of its balance: nothing when off, the cost model
    ("balance": [a, b]) and, when more than 1, "microbatches"."""
    if balance is None:
        return {}
    return {"balance": described(balance.model),
            **({"microbatches": balance.micro} if balance.micro > 1 else {}),
            **({"stratify": STRATIFY} if balance.stratify else {})}


def balanced_fingerprint(fingerprint: str, balance: Balancing | None) -> str:
    """A plan's fingerprint with balance off; on, a hash of it, the cost model and (when more
    than 1: states saved before microbatches existed still load) the microbatches; a state
    saved with one never loads into another.

    balanced_fingerprint("9f2c", None) == "9f2c"
    """
    if balance is None:
        return fingerprint
    micro = ["microbatches", balance.micro] if balance.micro > 1 else []
    strata = ["stratify", STRATIFY] if balance.stratify else []  # absent when off: unchanged
    return xxhash.xxh3_64_hexdigest(json.dumps([fingerprint, "balance", described(balance.model),
                                                *micro, *strata]).encode())


def row_lengths(plan: BatchPlan, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, offsets) of the documents in the inputs (seq_len tokens) of the rows at global
    ``positions``, from the plan's layout alone (``cuts.row_parts``): what
    ``balance.row_segments`` reads from the filled batch's segment_ids."""
    p = row_parts(plan, positions)
    n = np.minimum(p.offset + p.length, plan.seq_len) - p.offset  # a row's last token: a target
    keep = n > 0
    offsets = np.zeros(len(positions) + 1, np.int64)
    np.cumsum(np.bincount(p.row[keep], minlength=len(positions)), out=offsets[1:])
    return n[keep], offsets


def deal(plan: BatchPlan, consumed: int, *, batch_size: int, world_size: int,
         model: CostModel, stratify: bool = False) -> Deal:
    """The global batch at sample ``consumed`` (batch_size × world_size rows; with ``stratify``,
    the rows ``stratified_rows`` deals to its positions) dealt to the ranks by ``model``'s
    cost: the same on every rank."""
    positions = global_positions(consumed, batch_size=batch_size * world_size, rank=0,
                                 world_size=1)
    if stratify:
        positions, costs = stratified_rows(plan, positions, model)
    else:
        costs = row_costs(*row_lengths(plan, positions), model)
    rows = balance_rows(costs, world=world_size).reshape(world_size, batch_size)
    return Deal(costs, np.sort(rows, axis=1), positions)


def balanced_positions(plan: BatchPlan, consumed: int, *, batch_size: int, rank: int,
                       world_size: int, balance: Balancing) -> np.ndarray:
    """Rank's global sample positions of the global batch at ``consumed``, dealt by cost
    (ascending in the global batch; with microbatches, within each microbatch)."""
    d = deal(plan, consumed, batch_size=batch_size, world_size=world_size, model=balance.model,
             stratify=balance.stratify)
    return d.positions[in_microbatches(d, rank, balance.micro)]


# ---- stratified global batches ----------------------------------------------------------------

class Stratum(NamedTuple):
    """One block of an epoch, stratified: its first global position, and for each of its
    positions the plan position of the row dealt there and that row's cost."""

    first: int
    rows: np.ndarray  # int64
    costs: np.ndarray  # float64


def strata_block(n: int, j: int) -> tuple[int, int, int]:
    """(block, first row, end row) of row ``j`` of an epoch of ``n`` rows, cut in
    max(1, n // STRATA_ROWS) near-equal blocks.

    strata_block(10000, 5000) == (1, 5000, 10000)
    """
    blocks = max(1, n // STRATA_ROWS)
    b = ((j + 1) * blocks - 1) // n
    return b, b * n // blocks, (b + 1) * n // blocks


def stratum(plan: BatchPlan, position: int, model: CostModel) -> Stratum:
    """The stratified block holding global ``position``: its rows' costs read from the layout
    (``row_lengths``), dealt by ``balance.stratified_order`` (cached: the last few blocks)."""
    n = plan.samples_per_epoch
    epoch, j = divmod(int(position), n)
    b, first, end = strata_block(n, j)
    key = (epoch, b, model)
    with _STRATA_LOCK:
        cache = _STRATA.setdefault(plan, OrderedDict())
        hit = cache.get(key)
    if hit is not None:
        return hit
    rows = np.arange(epoch * n + first, epoch * n + end, dtype=np.int64)
    costs = row_costs(*row_lengths(plan, rows), model)
    order = stratified_order(costs, int(hash_ints(_TAG, plan.config.seed, epoch, b)))
    hit = Stratum(int(rows[0]), rows[order], costs[order])
    with _STRATA_LOCK:
        cache[key] = hit
        if len(cache) > CACHED_STRATA:
            cache.popitem(last=False)
    return hit


def stratified_rows(plan: BatchPlan, positions: np.ndarray, model: CostModel
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The plan positions of the rows the stratified order deals to the global ``positions`` (a
    run, e.g. a global batch), and their costs by ``model``."""
    got, at, end = [], int(positions[0]), int(positions[-1]) + 1
    while at < end:
        s = stratum(plan, at, model)
        upto = min(end, s.first + len(s.rows))
        assert s.first <= at < upto, (at, s.first, len(s.rows))  # the block holds ``at``
        got.append((s.rows[at - s.first:upto - s.first], s.costs[at - s.first:upto - s.first]))
        at = upto
    return tuple(np.concatenate(x) for x in zip(*got))


def in_microbatches(d: Deal, rank: int, micro: int) -> np.ndarray:
    """Rank's row indices of deal ``d`` in ``micro`` cost-balanced microbatches (1: as dealt)."""
    return d.rows[rank] if micro == 1 else microbatch_rows(d.costs, d.rows[rank], micro=micro)


def step_balance(plan: BatchPlan, consumed: int, *, batch_size: int, world_size: int,
                 balance: Balancing) -> dict[str, Any]:
    """The step at ``consumed``: max / mean cost across ranks, dealt and in plan order (rank r
    takes rows r·B … (r+1)·B − 1), and the cost model; with microbatches, max / mean across
    every (rank, microbatch) too, dealt and with each rank's rows in global order."""
    d = deal(plan, consumed, batch_size=batch_size, world_size=world_size, model=balance.model,
             stratify=balance.stratify)
    plan_order = np.arange(len(d.costs)).reshape(world_size, batch_size)
    out = {"step": consumed // (batch_size * world_size), "max_mean": imbalance(
               rank_costs(d.costs, d.rows)),
           "unbalanced_max_mean": imbalance(rank_costs(d.costs, plan_order)),
           "cost_model": described(balance.model)}
    if balance.micro == 1:
        return out
    m, per = balance.micro, batch_size // balance.micro
    dealt = np.stack([in_microbatches(d, r, m) for r in range(world_size)])
    return {**out, "microbatches": m,
            "microbatch_max_mean": imbalance(rank_costs(d.costs, dealt.reshape(-1, per))),
            "microbatch_max_mean_in_order": imbalance(rank_costs(d.costs, d.rows.reshape(-1, per)))}

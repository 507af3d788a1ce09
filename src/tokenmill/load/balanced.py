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
they do the plan-order rows); the deal balances whole steps, not microbatches within a rank.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import numpy as np
import xxhash

from tokenmill.load.balance import CostModel, balance_rows, cost_model_of, imbalance, rank_costs, \
    row_costs
from tokenmill.base.errors import ConfigError
from tokenmill.load.cuts import row_parts
from tokenmill.load.plan import BatchPlan, LayoutConfig, global_positions

__all__ = ["Deal", "balance_of", "balanced_fingerprint", "balanced_positions", "deal",
           "described", "row_lengths", "step_balance"]


class Deal(NamedTuple):
    """One step's deal: the cost of each row of the global batch (plan order), and each rank's
    row indices into it."""

    costs: np.ndarray  # float64 (B·W,)
    rows: np.ndarray  # int64 (W, B), each rank's ascending


def balance_of(balance: Any, config: LayoutConfig) -> CostModel | None:
    """A Loader's ``balance`` setting checked against its layout: None (off), "attention" or a
    CostModel, for rows that hold documents (packed, or concat with document_masks)."""
    model = cost_model_of(balance)
    if model is not None and config.layout != "packed" and not config.document_masks:
        raise ConfigError(f"balance={balance!r} needs rows whose documents are known: "
                          "layout='packed', or layout='concat' with document_masks=True (got "
                          f"layout={config.layout!r}); a concat window without document masks "
                          "attends across all of it, so every row costs the same")
    return model


def described(model: CostModel | None) -> list[float] | None:
    """The cost model as the state records it, [a, b] (None: balance off)."""
    return None if model is None else [float(model.a), float(model.b)]


def balanced_fingerprint(fingerprint: str, model: CostModel | None) -> str:
    """A plan's fingerprint with balance off; on, a hash of it and the cost model (a state saved
    with one never loads into the other).

    balanced_fingerprint("9f2c", None) == "9f2c"
    """
    if model is None:
        return fingerprint
    return xxhash.xxh3_64_hexdigest(json.dumps([fingerprint, "balance", described(model)]).encode())


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
         model: CostModel) -> Deal:
    """The global batch at sample ``consumed`` (batch_size × world_size rows) dealt to the
    ranks by ``model``'s cost: the same on every rank."""
    positions = global_positions(consumed, batch_size=batch_size * world_size, rank=0,
                                 world_size=1)
    costs = row_costs(*row_lengths(plan, positions), model)
    rows = balance_rows(costs, world=world_size).reshape(world_size, batch_size)
    return Deal(costs, np.sort(rows, axis=1))


def balanced_positions(plan: BatchPlan, consumed: int, *, batch_size: int, rank: int,
                       world_size: int, model: CostModel) -> np.ndarray:
    """Rank's global sample positions of the global batch at ``consumed``, dealt by cost
    (ascending)."""
    d = deal(plan, consumed, batch_size=batch_size, world_size=world_size, model=model)
    return consumed + d.rows[rank]


def step_balance(plan: BatchPlan, consumed: int, *, batch_size: int, world_size: int,
                 model: CostModel) -> dict[str, Any]:
    """The step at ``consumed``: max / mean cost across ranks, dealt and in plan order (rank r
    takes rows r·B … (r+1)·B − 1), and the cost model."""
    d = deal(plan, consumed, batch_size=batch_size, world_size=world_size, model=model)
    plan_order = np.arange(len(d.costs)).reshape(world_size, batch_size)
    return {"step": consumed // (batch_size * world_size), "max_mean": imbalance(
                rank_costs(d.costs, d.rows)),
            "unbalanced_max_mean": imbalance(rank_costs(d.costs, plan_order)),
            "cost_model": described(model)}

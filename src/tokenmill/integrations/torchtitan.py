"""torchtitan: a tokenmill store as torchtitan's data loader, through its own dataloader protocol.

    from tokenmill.integrations.torchtitan import TokenmillDataLoader
    config.dataloader = TokenmillDataLoader.Config(dataset_path="store/", layout="packed")
    # torchtitan's Trainer then calls, as for its own loaders:
    dataloader = config.dataloader.build(dp_world_size=W, dp_rank=r, tokenizer=tokenizer,
                                         seq_len=2048, local_batch_size=8)

torchtitan (0.3) asks of a data loader what its ``BaseDataLoader`` says: a ``Configurable`` whose
``Config`` (a ``dataclass(kw_only=True, slots=True)``) builds it with the runtime keywords above;
iteration yielding ``(input_dict, labels)`` — ``input_dict["input"]`` the token ids, optional
``"positions"`` (restarting at 0 at every document: its Flex and varlen attention cut documents
where positions reset, and RoPE reads them), ``labels`` with -100 where no loss is taken; and the
``Stateful`` pair ``state_dict``/``load_state_dict`` that its checkpointer saves with the model.

Here: the Loader of ``dataset_path`` (rank ``dp_rank`` of ``dp_world_size``, batch
``local_batch_size``, torchtitan's ``seq_len``); concat rows as ``{"input"}``, packed rows also with
``"positions"`` (``attention.flat_position_ids``: padding counts on after its document, so it
starts none) and ``labels`` = targets, -100 off ``loss_mask``. The tokenizer is not used: the
tokens are the store's. ``state_dict()`` is ``{"tokenmill": json of the Loader's state}`` — one
string under one key, so torchtitan's DCP checkpoint holds the same structure whatever the stream,
and identical on every rank (``consumed_samples`` is global), so DCP keeping one rank's copy loses
nothing and a run may resume on another number of data-parallel ranks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader

from tokenmill.load import attention
from tokenmill.base.errors import ConfigError
from tokenmill.integrations.torch import IGNORE_INDEX
from tokenmill.load.loader import Loader

__all__ = ["TokenmillDataLoader", "titan_batch"]

STATE_KEY = "tokenmill"


def titan_batch(batch: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A Loader batch as torchtitan's ``(input_dict, labels)``, int64, on the batch's device.

    titan_batch({"inputs": x, "targets": y})[1].dtype == torch.int64
    """
    inputs = torch.as_tensor(batch["inputs"]).to(torch.int64)
    labels = torch.as_tensor(batch["targets"]).to(torch.int64)
    if "loss_mask" in batch:
        labels = labels.masked_fill(torch.as_tensor(batch["loss_mask"]).to(labels.device) == 0,
                                    IGNORE_INDEX)
    input_dict = {"input": inputs}
    if "segment_ids" in batch:  # packed: document boundaries where positions reset to 0
        seg = torch.as_tensor(batch["segment_ids"]).cpu().numpy()
        input_dict["positions"] = torch.from_numpy(attention.flat_position_ids(seg)).to(inputs.device)
    return input_dict, labels


class TokenmillDataLoader(BaseDataLoader):
    """torchtitan's data loader over a tokenmill store (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        layout: str = "concat"
        """'concat' (fixed windows of the token stream) or 'packed' (whole documents, positions)"""

        seed: int = 0
        """The order's seed: batch k is a pure function of (store, layout, seed, k)"""

        max_segments: int | None = None
        """Packed rows: at most this many documents a row (None: no cap)"""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int,
                 local_batch_size: int, tokenizer: Any = None, **kwargs: Any):
        if not config.dataset_path:
            raise ConfigError("TokenmillDataLoader.Config needs dataset_path: the folder of a "
                              "tokenmill store (made by 'tokenmill prepare')")
        self.loader = Loader(config.dataset_path, seq_len=seq_len, batch_size=local_batch_size,
                             seed=config.seed, rank=dp_rank, world_size=dp_world_size,
                             layout=config.layout, max_segments=config.max_segments)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for batch in self.loader.iterate(view=torch.from_numpy):
            yield titan_batch(batch)

    def state_dict(self) -> dict[str, Any]:
        """``{"tokenmill": the Loader's state as JSON}``, as of the last batch handed out."""
        return {STATE_KEY: json.dumps(self.loader.state_dict())}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue after the saved state; an empty state (nothing saved) leaves the position."""
        if not state_dict:
            return
        if STATE_KEY not in state_dict:
            raise ConfigError(f"this dataloader state is not a tokenmill one (keys "
                              f"{sorted(state_dict)}); was the checkpoint saved with another "
                              "torchtitan data loader? Use that loader, or exclude 'dataloader' "
                              "from loading to start this stream at its beginning")
        self.loader.load_state_dict(json.loads(state_dict[STATE_KEY]))

    def close(self) -> None:
        """Close the Loader (its workers, its stores)."""
        self.loader.close()

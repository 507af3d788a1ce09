"""Splits of a folder of inputs: which files are "train", which "validation", and ``--split``.

A folder given as an input may hold several splits of one dataset; prepared together they would
put validation or test data into a training store. Two layouts are recognised:

- a ``datasets`` ``DatasetDict`` saved with ``save_to_disk``: ``dataset_dict.json``
  (``{"splits": ["train", "validation"]}``) and one dataset folder per split;
- the Hugging Face Hub's file names: a folder or a file name (up to its first ``-`` or ``.``)
  that is a split name — ``train/…``, ``data/train-00000-of-00002.parquet``, ``test.jsonl``,
  ``default/validation/0000.parquet`` (the Hub's parquet conversion). A split name is one of
  ``dataset_dict.json``'s, the one asked for, or a name whose ``_``-separated words include
  one of KEYWORDS (so ``train_sft`` and ``test_gen`` are splits, ``data`` and ``en`` are not).

Only the path *below* the folder counts (a corpus kept in ``~/test/`` has no split). A folder
whose files carry two splits or more is refused unless ``split`` names one; with ``split``, only
its files are taken (and a folder that has splits, but not that one, is refused with the list).
A folder without splits, a file, or a glob is taken whole: name ``dir/train`` to take one
split without ``--split``, or a glob to take several.

    file_split("data/train-00000-of-00002.parquet") == "train"
    file_split("en/part-0.jsonl") is None
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Collection, Sequence

from tokenmill.base.errors import InputError

DATASET_DICT = "dataset_dict.json"  # DatasetDict.save_to_disk: {"splits": ["train", …]}
KEYWORDS = frozenset({"train", "training", "validation", "valid", "val", "dev", "test", "testing",
                      "eval", "evaluation"})  # the words ``datasets`` reads as split names
_WORD = re.compile(r"[A-Za-z]+(?:_[A-Za-z]+)*")


def file_split(relpath: str, names: Collection[str] = ()) -> str | None:
    """The split of a file from its path below the listed folder; None if it names none."""
    for part in relpath.replace("\\", "/").split("/"):
        stem = re.split(r"[-.]", part, maxsplit=1)[0]
        if part in names or stem in names:
            return part if part in names else stem
        word = _WORD.match(part)
        if word and any(w in KEYWORDS for w in word.group().lower().split("_")):
            return word.group()
    return None


def dict_splits(data: bytes | None) -> list[str]:
    """The split names of a dataset_dict.json's bytes ([] if absent or not one)."""
    try:
        names = json.loads(data)["splits"] if data else []
    except (ValueError, TypeError, KeyError):
        return []
    return [n for n in names if isinstance(n, str) and n] if isinstance(names, list) else []


def choose(folder: str, files: Sequence[str], relative: Callable[[str], str],
           split: str | None, names: Collection[str] = ()) -> list[str]:
    """The files of a folder to read: those of ``split``, or all when the folder has at most one
    split; ``relative(f)`` is f's path below the folder, ``names`` the DatasetDict's splits."""
    known = set(names) | ({split} if split else set())
    of = {f: file_split(relative(f), known) for f in files}
    counts = Counter(s for s in of.values() if s is not None)
    if split is None:
        if len(counts) < 2:
            return list(files)
        raise InputError(f"{folder}: holds {len(counts)} splits ({_listed(counts)}); preparing "
                         "them together would mix evaluation data into training; pass --split NAME "
                         "(Python: split='NAME') and make one store per split, or name a split's "
                         "folder or files",
                         path=folder, where="file", reason="no_match")
    if not counts:
        return list(files)
    if split not in counts:
        raise InputError(f"{folder}: no split {split!r}; its splits are {_listed(counts)}",
                         path=folder, where="file", reason="no_match")
    return [f for f in files if of[f] == split]


def _listed(counts: Counter) -> str:
    """"train (3 files), validation (1 file)"."""
    return ", ".join(f"{s} ({n} file{'s' * (n != 1)})" for s, n in sorted(counts.items()))

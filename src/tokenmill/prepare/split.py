"""A validation split by content: which documents a side keeps, and where the two stores go.

A document is on the val side when the xxh3-64 of its text (UTF-8; after the transform) is below
``fraction · 2^64``, else on the train side. It depends on nothing but the text, so the split is
the same for any worker count, engine, unit size and resume, a document keeps its side when the
corpus grows, and no document is on both sides (identical documents are on the same one).

    kept_indices(["a", "b", "c", "d"], ("val", 0.5)) == [1, 3]   # "b", "d" are on the val side
    split_paths("out") == {"train": "out/train", "val": "out/val"}

``prepare(..., val_fraction=F)`` runs prepare twice on the same inputs, ``holdout=("train", F)``
into ``<out>/train`` and ``holdout=("val", F)`` into ``<out>/val``: each pass is an ordinary,
resumable, lockable prepare (either engine), and each store's manifest records its side, the
fraction (``settings.holdout``) and how many documents went to the other side: they count as
``held_out`` skips (no examples kept), so the count survives a resume; ``split_of`` reads them.

The two passes must agree per document, not only in number: each pass records, per input file,
the sum (mod 2^64) of the xxh3-64 of every document's text as its transform made it, either side
(``texts_sum`` per unit, kept with the writer's progress records across a resume; the manifest's
``split_texts_xxh3``, one per ``sources`` entry, independent of units and workers).
``check_accounts`` compares them: a record given two texts (a transform random outside the
sampled records) would be on both sides or on neither even when the counts agree.
"""

from __future__ import annotations

import numbers
import os
import posixpath
from collections.abc import Sequence

import xxhash

from tokenmill.base.errors import ConfigError
from tokenmill.base.io import is_url
from tokenmill.inputs.records import Skip
from tokenmill.store.format import SIDES, split_paths  # the two stores' places: the store knows
HELD_OUT = "held_out"
SPLIT_TEXTS = "split_texts_xxh3"  # the manifest's per-input sums of document text hashes
MASK64 = (1 << 64) - 1


def check_holdout(holdout) -> tuple[str, float] | None:
    """``holdout`` as a (side, fraction) tuple, checked; None stays None.

    check_holdout(["val", 0.01]) == ("val", 0.01)
    """
    if holdout is None:
        return None
    try:
        side, fraction = holdout
    except (TypeError, ValueError):
        raise ConfigError(f"holdout must be (side, fraction), e.g. ('val', 0.01) "
                          f"(got holdout={holdout!r})") from None
    if side not in SIDES:
        raise ConfigError(f"holdout side must be 'train' or 'val' (got {side!r})")
    check_fraction(fraction)
    return side, float(fraction)


def check_fraction(fraction) -> float:
    """``fraction`` if it is a number strictly between 0 and 1, else a ConfigError."""
    # numbers.Real: numpy floats of every width too (np.float32(0.1) is a fraction, as 0.1 is)
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or \
            not 0 < fraction < 1:
        raise ConfigError(f"val_fraction must be a number between 0 and 1, exclusive (got "
                          f"{fraction!r}); e.g. --val-fraction 0.005 holds out 0.5% of documents")
    return float(fraction)


def is_val(text: str, fraction: float) -> bool:
    """Whether ``text`` is on the val side of a split holding out ``fraction`` of documents.

    is_val("a", 0.5) is False and is_val("b", 0.5) is True
    """
    return kept_indices([text], ("val", fraction)) == [0]


def kept_indices(texts: Sequence[str], holdout: tuple[str, float]) -> list[int]:
    """Indices of the texts on ``holdout``'s side, in order (the two sides partition them).

    kept_indices(["a", "b", "c", "d"], ("val", 0.5)) == [1, 3]
    """
    return sided(text_hashes(texts), holdout)


def text_hashes(texts: Sequence[str]) -> list[int]:
    """The xxh3-64 of each text (UTF-8) that decides its side."""
    hash64 = xxhash.xxh3_64_intdigest
    # "surrogatepass": a lone surrogate decoded from JSON ("\ud800") must not raise here
    return [hash64(t.encode("utf-8", "surrogatepass")) for t in texts]


def sided(hashes: Sequence[int], holdout: tuple[str, float]) -> list[int]:
    """Indices of the texts whose ``text_hashes`` put them on ``holdout``'s side, in order."""
    side, fraction = holdout
    below, want_val = int(fraction * 2.0 ** 64), side == "val"
    return [i for i, h in enumerate(hashes) if (h < below) == want_val]


def texts_sum(hashes: Sequence[int]) -> str:
    """What a unit records of its documents for ``check_accounts``: the sum of their
    ``text_hashes`` mod 2^64, in hex (order-free: units add up to their file's).

    texts_sum([1, 2]) == "0000000000000003"
    """
    return f"{sum(hashes) & MASK64:016x}"


def keep_side(texts: list[str], skips: list[tuple[int, Skip]], holdout: tuple[str, float],
              path: str, hashes: Sequence[int] | None = None
              ) -> tuple[list[int], list[tuple[int, Skip]]]:
    """The indices of a unit's texts on ``holdout``'s side, and its skips (ordinals into texts)
    with the other side's texts taken out: each becomes a ``held_out`` Skip, and every ordinal
    counts kept texts only (apply the indices to the texts and their origins in lockstep).
    ``hashes``: the texts' ``text_hashes``, when already at hand."""
    kept = sided(text_hashes(texts) if hashes is None else hashes, holdout)
    if len(kept) == len(texts):
        return kept, skips
    other = "val" if holdout[0] == "train" else "train"
    new_skips: list[tuple[int, Skip]] = []
    s, k = 0, 0  # next old skip, kept texts so far
    keep = set(kept)
    for i in range(len(texts) + 1):
        while s < len(skips) and skips[s][0] <= i:
            new_skips.append((k, skips[s][1]))
            s += 1
        if i < len(texts):
            if i in keep:
                k += 1
            else:
                new_skips.append((k, Skip(path, "document", HELD_OUT, f"on the {other} side")))
    return kept, new_skips


def check_split_out(out: str | os.PathLike) -> None:
    """Refuse an ``out`` that already holds a plain store (or a plain prepare's progress)."""
    out = os.fspath(out)
    if is_url(out):
        from tokenmill.base.io import read_bytes
        plain = read_bytes(posixpath.join(out, "manifest.json")) is not None
    else:
        plain = any(os.path.exists(os.path.join(out, name)) for name in
                    ("manifest.json", ".progress"))
    if plain:
        raise ConfigError(f"{out}: holds a store (or an unfinished prepare) made without "
                          "--val-fraction; a split writes two stores, "
                          f"{split_paths(out)['train']} and {split_paths(out)['val']}: choose "
                          "another --out, or delete this one")


def split_sides(path: str | os.PathLike) -> dict[str, str] | None:
    """``{"train": path/train, "val": path/val}`` when the local folder ``path`` holds a split's
    two stores (and no store of its own), else None."""
    sides = split_paths(path)
    if is_url(path) or os.path.exists(os.path.join(path, "manifest.json")) or not all(
            os.path.exists(os.path.join(p, "manifest.json")) for p in sides.values()):
        return None
    return sides


def check_plain_out(out: str | os.PathLike) -> None:
    """Refuse to write a plain store into a local folder that holds a split's two stores."""
    out = os.fspath(out)
    if not is_url(out) and any(os.path.exists(os.path.join(p, "manifest.json")) or
                               os.path.exists(os.path.join(p, ".progress"))
                               for p in split_paths(out).values()):
        raise ConfigError(f"{out}: holds the train/ and val/ stores of a split; pass the same "
                          "--val-fraction to finish or reuse it, or choose another --out")


def split_of(manifest: dict) -> dict | None:
    """A store's side of a split, from its manifest: {"side", "fraction", "held_out"} (documents
    on the other side), or None for a store that is not one side of a split."""
    holdout = manifest.get("settings", {}).get("holdout")
    if not holdout:
        return None
    held = manifest.get("skipped", {}).get("by_reason", {}).get(HELD_OUT, 0)
    return {"side": holdout[0], "fraction": holdout[1], "held_out": held}


def check_accounts(train: dict, val: dict) -> None:
    """Refuse a split whose two stores do not account for the same documents: what one side
    kept must be what the other held out, and each input's documents must have had the same
    texts in both passes (``split_texts_xxh3``; a transform that gives a record two texts puts
    it on both sides, or on neither, even when the counts agree)."""
    kept = {"train": train["num_documents"], "val": val["num_documents"]}
    held = {"train": split_of(train)["held_out"], "val": split_of(val)["held_out"]}
    differ = differing_input(train, val)
    if differ is None and kept["train"] == held["val"] and kept["val"] == held["train"]:
        return
    transform = train.get("settings", {}).get("transform", "").split(" (")[0]
    which = f"the records of {differ}" if differ else "some records"
    why = (f"the transform {transform} gave {which} other texts in the two passes: it is not "
           "deterministic (in every process and at every call? e.g. no set order or hash() of "
           "str, no time, no unseeded random, no state kept between calls)" if transform else
           "the inputs changed between the two passes" + (f" ({differ})" if differ else ""))
    raise ConfigError(f"the split does not account for every document: the train store holds "
                      f"{kept['train']:,} and held out {held['train']:,}, the val store holds "
                      f"{kept['val']:,} and held out {held['val']:,} (each side must hold what "
                      f"the other held out, document by document); {why}: fix that and run "
                      "again with --overwrite")


def differing_input(train: dict, val: dict) -> str | None:
    """The first input whose documents' texts differ between the two passes' manifests
    (``split_texts_xxh3``); None if none does, or a manifest does not record them."""
    a, b = train.get(SPLIT_TEXTS), val.get(SPLIT_TEXTS)
    names = train.get("sources") or []
    if not a or not b or names != val.get("sources") or not len(a) == len(names) == len(b):
        return None
    return next((name for name, x, y in zip(names, a, b) if x != y), None)


def texts_record(files: Sequence[str], units: Sequence, sums: dict[int, str]) -> dict:
    """The manifest's ``split_texts_xxh3``: per input file (``files``, in the order ``sources``
    records them), the sum of its ``units``' ``texts_sum`` (``sums``, by unit index); {} if a unit has none (a
    run resumed from progress recorded before this)."""
    if any(u not in sums for u in range(len(units))):
        return {}
    total = dict.fromkeys(files, 0)
    for u, unit in enumerate(units):
        if unit.path not in total:
            return {}
        total[unit.path] = (total[unit.path] + int(sums[u], 16)) & MASK64
    return {SPLIT_TEXTS: [f"{total[f]:016x}" for f in files]}


def split_line(split: dict, documents: int) -> str:
    """One line on a store's side of a split.

    split_line({"side": "val", "fraction": 0.01, "held_out": 990}, 10) ==
    "val side (fraction 0.01): 10 of 1,000 documents (990 on the train side)"
    """
    other = "train" if split["side"] == "val" else "val"
    total = documents + split["held_out"]
    return (f"{split['side']} side (fraction {split['fraction']:.4g}): {documents:,} of "
            f"{total:,} documents ({split['held_out']:,} on the {other} side)")

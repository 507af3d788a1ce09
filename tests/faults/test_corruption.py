"""Damage every file kind of a store: verify finds all of it; the Loader refuses, naming the file.

Failure class: training on a damaged store without knowing it (a flipped byte, a truncated,
extended or missing file).
"""

from __future__ import annotations

import random
import shutil
import warnings
from pathlib import Path

import pytest

from conftest import stdlib_texts, write_jsonl
from faults.conftest import SIZE, record
from faults.programs import digest
from tokenmill import Loader
from tokenmill.base.errors import StoreError
from tokenmill.prepare import prepare
from tokenmill.store import IDX_HEADER, read_manifest, verify_store

LAYOUTS = ("concat", "packed")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A real store (several shards), and the Loader's streams."""
    root = tmp_path_factory.mktemp("pristine")
    write_jsonl(root / "c.jsonl", stdlib_texts(120_000))
    store = root / "store"
    prepare([str(root / "c.jsonl")], out=store, workers=1, progress=False, shard_tokens=40_000)
    assert verify_store(store) == []
    streams = {layout: loader_stream(store, layout) for layout in LAYOUTS}
    assert len(read_manifest(store)["shards"]) >= 3
    return store, streams


def loader_stream(store: Path, layout: str) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a damaged layout cache is rebuilt with a warning
        with Loader(store, seq_len=64, batch_size=4, layout=layout, seed=3, num_workers=0,
                    rank=0, world_size=1) as loader:
            return [digest(b) for _, b in zip(range(12), loader)]


def flip(offset: int, mask: int):
    def damage(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= mask
        path.write_bytes(bytes(data))
    return damage


def truncate(size: int):
    def damage(path: Path) -> None:
        with open(path, "r+b") as f:
            f.truncate(size)
    return damage


def extend(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0")


def delete(path: Path) -> None:
    path.unlink()


def cases_for(size: int, rng: random.Random, every_byte: bool) -> list[tuple[str, object, int]]:
    """(description, damage, flipped offset or -1) for one file of ``size`` bytes: byte flips
    (every byte with each of SIZE.flip_masks plus random ones, or random bytes), truncations, one
    byte more, deletion."""
    if every_byte:
        flips = [(o, m) for o in range(size) for m in SIZE.flip_masks]
        flips += [(rng.randrange(size), rng.randrange(1, 256)) for _ in range(size // 8)]
    else:
        flips = [(rng.randrange(size), rng.randrange(1, 256)) for _ in range(150)]
    cases = [(f"byte {o} ^ {m:#04x}", flip(o, m), o) for o, m in flips]
    cases += [(f"truncated to {n}", truncate(n), -1) for n in sorted({0, size // 2, size - 1})]
    return cases + [("one byte more", extend, -1), ("deleted", delete, -1)]


def test_every_damage_to_every_store_file_is_found_by_verify_and_never_read_silently(
        tmp_path, pristine):
    store, streams = pristine
    manifest = read_manifest(store)
    docs = {f"{s['name']}.idx": s["num_documents"] for s in manifest["shards"]}
    work = tmp_path / "store"
    shutil.copytree(store, work)
    rng = random.Random(11)
    names = ["manifest.json", "shard-00000.bin", "shard-00000.idx", "shard-00001.idx",
             f"{manifest['shards'][-1]['name']}.bin"]
    counts = {"damaged": 0, "found_by_verify": 0, "refused_by_loader": 0,
              "read_identically": 0}
    missed, silent = [], []
    for name in names:
        path, original = work / name, (store / name).read_bytes()
        every_byte = name.endswith((".json", ".idx"))
        for case, damage, offset in cases_for(len(original), rng, every_byte):
            damage(path)
            counts["damaged"] += 1
            problems = verify_store(work)
            if any(str(path) in p for p in problems):
                counts["found_by_verify"] += 1
            else:
                missed.append(f"{name} {case}: {problems}")
            # the Loader never reads a damaged store as if it were intact: it refuses, naming
            # the file, or (for bytes it does not use) gives exactly the undamaged stream.
            # Token bytes are the exception: finding those is verify's job (it reads them all).
            if not (name.endswith(".bin") and offset >= 0):
                for layout in LAYOUTS:
                    # always refused: a shard file of another size, or missing; an index header;
                    # document lengths under the packed layout (it packs by them). (A manifest
                    # whose bytes changed but whose content did not, say a dropped final newline,
                    # may be read: verify still reports it.)
                    must_refuse = name != "manifest.json" and (offset < 0 or (
                        offset < IDX_HEADER.size + 4 * docs[name] * (layout == "packed")))
                    try:
                        got = loader_stream(work, layout)
                    except StoreError as e:
                        if str(path) in str(e):
                            counts["refused_by_loader"] += 1
                        else:
                            silent.append(f"{name} {case} {layout}: refused for another reason: {e}")
                        continue
                    if got == streams[layout] and not must_refuse:
                        counts["read_identically"] += 1
                    else:
                        silent.append(f"{name} {case} {layout}: opened and read")
            path.write_bytes(original)
    assert missed == [], f"verify missed {len(missed)} of {counts['damaged']}: {missed[:5]}"
    assert silent == [], f"the Loader read {len(silent)} damaged stores: {silent[:5]}"
    record("corruption", **counts, found_fraction=counts["found_by_verify"] / counts["damaged"])

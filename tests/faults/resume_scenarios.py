"""Resume scenarios drawn at random, each checked token for token against a run that never stopped.

A scenario is one training run cut into legs. A leg opens one loader per rank (W of them, stepped
in lockstep as a W-rank job steps), loads the state the last leg saved, takes some steps and
stops; the next leg may run on another world size (W = 2 → 3 → 1), global batch, worker count and
type, and a mixture whose phases after the checkpoint were edited. Every global batch (the ranks'
batches put together in rank order, every array: inputs, targets and, packed, segment_ids,
positions, loss_mask) must equal the rows at the same global sample positions of an uninterrupted
run with the leg's settings; an edit of a phase the run has consumed must be refused, any other
edit accepted. Stops are in-process (stop iterating, take ``state_dict``, open new loaders and
``load_state_dict``: "stop"; a new iterator every step: "reiter"; resume from an earlier step's
state: "rewind") or a real ``kill -9`` of a child process that checkpoints every step ("kill9").

Only the public API is used (``Loader``, ``Loader.from_text``, ``state_dict``,
``load_state_dict``, the mixture arguments), so the fuzzer tests whatever is behind it.

``draw(seed, world)`` → ``Scenario`` (pure: the seed and the world fix every parameter);
``faults.resume_runner.check(scenario, world, tmp)`` runs it and raises ``ScenarioFailed``
whose message names the seed and every parameter in one line. tests/faults/test_resume_fuzz.py runs seeds 0…N-1;
benchmarks/fuzz_resume.py runs more, and on the user's own stores. (This module lives under
tests/ rather than in tokenmill: it is test machinery that users run from a checkout, not an API
to keep; tests never import benchmarks/, and the benchmark imports it by path.)
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill import Loader

OFFSET = 1_000_000  # positional store i holds tokens i·OFFSET + position: a row names its store
STOPS = ("stop", "reiter", "rewind")  # in-process; "kill9" only where a scenario asks for it
# Failures the fuzzer found that are not fixed yet: ``draw`` leaves them out (each has a fixed
# scenario in tests/faults/test_resume_fuzz.py, expected to fail until fixed); remove a name
# here when its fix lands.
KNOWN_FAILURES: frozenset[str] = frozenset()
# The settings a resume may not change, and the change tried (the refusal must name the key)
UNSAFE = {"seq_len": lambda v: v // 2, "seed": lambda v: v + 1,
          "layout": lambda v: {"concat": "packed", "packed": "concat"}[v],
          "max_segments": lambda v: 2 if v is None else v + 1,
          "shuffle_buffer": lambda v: v + 1, "pack_window": lambda v: v + 1}


# ---- the world: stores and text sources, built once --------------------------------------------

@dataclass(frozen=True)
class World:
    """What scenarios draw from: stores by name (``mixable``: those of one tokenizer), text
    folders by name for ``Loader.from_text``, and the seq_lens to try."""

    stores: dict[str, str]
    mixable: tuple[str, ...]
    texts: dict[str, str]
    seq_lens: tuple[int, ...]
    layout_cache: str | None = None  # where packed layouts go (None: next to each store)


def paragraphs(size: int, pattern: str) -> list[str]:
    """About ``size`` bytes of real text (the standard library's sources) cut at blank lines:
    short documents."""
    from conftest import stdlib_texts
    out, total = [], 0
    for p in (p for t in stdlib_texts(size, pattern) for p in t.split("\n\n") if p.strip()):
        if total >= size:
            break
        out.append(p)
        total += len(p.encode()) + 1
    return out


def build_world(root: Path) -> World:
    """Three small positional stores (tokens name their store and position), one store prepared
    from real text, and three small text folders: a few KB each, so runs cross epochs."""
    from conftest import lengths_summing_to, write_jsonl, write_positional_store
    from tokenmill import prepare
    root.mkdir(parents=True, exist_ok=True)
    sizes = {"web": 1500, "code": 600, "math": 400}
    stores = {n: str(write_positional_store(
        root / "stores" / n, lengths_summing_to(size, docs=size // 14, longest=26, seed=i),
        offset=i * OFFSET)) for i, (n, size) in enumerate(sizes.items())}
    texts = {}
    # passes of 40 to 150 samples: most runs cross the end of a pass, many more than once
    for name, pattern, size in (("web", "*.py", 2400), ("code", "json/*.py", 1600),
                                ("mail", "email/*.py", 1300)):
        (root / "text" / name).mkdir(parents=True)
        write_jsonl(root / "text" / name / "docs.jsonl", paragraphs(size, pattern))
        texts[name] = str(root / "text" / name)
    stores["text"] = str(root / "stores" / "text")
    prepare([texts["web"]], out=stores["text"], tokenizer="bytes", workers=1, progress=False,
            shard_tokens=2000)
    return World(stores, ("web", "code", "math"), texts, (8, 16))


# ---- scenarios ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Leg:
    """One stretch of the run between two resumes."""

    world_size: int
    batch_size: int  # per rank
    num_workers: int | str
    worker_type: str
    steps: int  # steps taken before this leg stops
    stop: str  # "stop" | "reiter" | "rewind" | "kill9"
    mixture: tuple | None  # named: the phases this leg asks for (edited at resume)
    weights: tuple | None  # fixed weights: this leg's spelling of them
    state_rank: int  # the rank whose state_dict is saved
    rewind: float  # "rewind": resume from this fraction of the leg's steps
    change: tuple | None = None  # (key, value): an unsafe setting tried first, to be refused


@dataclass(frozen=True)
class Scenario:
    """A run cut into legs; every parameter is drawn from ``seed``."""

    seed: int
    source: str  # "store" | "stream"
    names: tuple[str, ...]
    spelling: str  # "one" | "named" | "weights"
    layout: str
    max_segments: int | None
    seq_len: int
    loader_seed: int
    cache: str  # stream: "shared" (one cache for every loader) | "per-leg" | "per-rank"
    stream_options: tuple  # ((key, value), …): shuffle_buffer, pack_window, unit_bytes, …
    legs: tuple[Leg, ...]
    ints: str = "python"  # "numpy": every integer setting given as a numpy integer

    def line(self) -> str:
        """The scenario in one line: its seed and every parameter."""
        head = (f"seed={self.seed} {self.source} {self.layout}"
                f"{'' if self.max_segments is None else f' max_segments={self.max_segments}'}"
                f" L={self.seq_len} loader_seed={self.loader_seed} {self.spelling}"
                f"({','.join(self.names)}){' numpy ints' if self.ints == 'numpy' else ''}")
        if self.source == "stream":
            head += f" cache={self.cache} " + " ".join(f"{k}={v}" for k, v in self.stream_options)
        legs = [f"W{g.world_size}×{g.batch_size} workers={g.num_workers}"
                f"{'/' + g.worker_type if g.worker_type != 'thread' else ''} {g.stop}"
                f"({g.steps}{f', back to {g.rewind:.2f}' if g.stop == 'rewind' else ''})"
                f" state of rank {g.state_rank}"
                f"{f' mixture={list(g.mixture)}' if g.mixture is not None else ''}"
                f"{f' weights={list(g.weights)}' if g.weights is not None else ''}"
                f"{f' (first tried {g.change[0]}={g.change[1]!r})' if g.change else ''}"
                for g in self.legs]
        return head + " | " + " | ".join(legs)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Scenario:
        d = json.loads(text)
        legs = tuple(Leg(**{**g, "mixture": phases_of(g["mixture"]),
                            "weights": None if g["weights"] is None else tuple(g["weights"]),
                            "change": None if g["change"] is None else tuple(g["change"])})
                     for g in d.pop("legs"))
        return cls(**{**d, "names": tuple(d["names"]), "legs": legs,
                      "stream_options": tuple(tuple(kv) for kv in d["stream_options"])})


def phases_of(obj) -> tuple | None:
    """Phases from their JSON form (lists) back to tuples ((start, ((name, weight), …)), …)."""
    if obj is None:
        return None
    return tuple((int(s), tuple((n, w) for n, w in (ws.items() if isinstance(ws, dict) else ws)))
                 for s, ws in obj)


def draw(seed: int, world: World, *, kill9: bool = False) -> Scenario:
    """The scenario of ``seed`` (``kill9``: one leg is a child process killed with SIGKILL)."""
    rng = random.Random(seed)
    source = "stream" if world.texts and (not world.stores or rng.random() < 0.35) else "store"
    pool = tuple(world.texts) if source == "stream" else world.mixable
    singles = tuple(world.texts) if source == "stream" else tuple(world.stores)
    spelling = rng.choices(["one", "named", "weights"], [40, 45, 15])[0] \
        if len(pool) > 1 else "one"
    names = (rng.choice(singles),) if spelling == "one" else \
        tuple(rng.sample(pool, rng.randint(2, len(pool))))
    layout = rng.choice(["concat", "packed"])
    max_segments = rng.choice([None, None, 1, 2, 3, 4]) if layout == "packed" else None
    seq_len = rng.choice(world.seq_lens) * (2 if source == "stream" else 1)
    loader_seed = rng.choice([0, 1, rng.randrange(2**32), rng.randrange(2**63)])
    options = ()
    if source == "stream":
        options = (("shuffle_buffer", rng.choice([1, 4, 16])),
                   ("unit_bytes", rng.choice([700, 1500, 4000])),
                   ("shard_tokens", rng.choice([1500, 5000])))
        if layout == "packed":
            options += (("pack_window", rng.choice([1, 3, 8, 64])),)
    legs = draw_legs(rng, source, spelling, names, kill9)
    legs = draw_changes(rng, legs, source, layout, dict(
        options, seq_len=seq_len, seed=loader_seed, layout=layout, max_segments=max_segments))
    ints = "numpy" if "numpy integer settings" not in KNOWN_FAILURES and rng.random() < 0.15 \
        else "python"
    cache = rng.choice(["shared", "per-leg", "per-rank"])
    return Scenario(seed, source, names, spelling, layout, max_segments, seq_len, loader_seed,
                    cache, options, legs, ints)


def draw_changes(rng: random.Random, legs: tuple[Leg, ...], source: str, layout: str,
                 settings: dict) -> tuple[Leg, ...]:
    """At about one resume in six, first try a setting that may not change (it must be refused,
    naming it): seq_len, seed, layout, max_segments (packed); streams also shuffle_buffer,
    pack_window."""
    keys = ["seq_len", "seed", "layout"] + (["max_segments"] if layout == "packed" else [])
    if source == "stream":
        keys += ["shuffle_buffer"] + (["pack_window"] if layout == "packed" else [])
        if "stream refusal unnamed" in KNOWN_FAILURES:
            keys = [k for k in keys if k not in ("max_segments", "pack_window", "layout")]
    out = [legs[0]]
    for leg in legs[1:]:
        if rng.random() < 1 / 6:
            key = rng.choice(keys)
            leg = dataclasses.replace(leg, change=(key, UNSAFE[key](settings[key])))
        out.append(leg)
    return tuple(out)


def draw_legs(rng: random.Random, source: str, spelling: str, names: tuple[str, ...],
              kill9: bool) -> tuple[Leg, ...]:
    """2 to 4 legs: world sizes and global batches (6 or 12), workers, stops, mixture edits."""
    n = rng.choice([2, 3, 3, 4])
    killed = rng.randrange(n - 1) if kill9 else -1
    mixture = draw_phases(rng, names) if spelling == "named" else None
    weights = tuple(draw_weight(rng) for _ in names) if spelling == "weights" else None
    gb = rng.choice([6, 12])
    legs = []
    for i in range(n):
        if i and rng.random() < 0.2:
            gb = 18 - gb  # 6 ↔ 12: the global batch changes at a resume
        world_size = rng.choice([1, 2, 3])
        if i:
            mixture = edit_phases(rng, mixture, names, source) if mixture is not None else None
            weights = respelled(rng, weights) if weights is not None else None
        # worker processes cost a start-up each (~0.3 s): a few legs in twenty start at most 2
        if source == "store":
            workers, kind = rng.choice([0, 0, 1, 2, "auto"]), "thread"
            if rng.random() < 0.06:
                workers, kind = rng.choice([1, 1, 2, "auto"]), "process"
        else:
            workers, kind = rng.choices([0, 1, 2], [90, 7, 3])[0], "thread"
        if workers and (kind == "process" or source == "stream"):
            world_size = min(world_size, 2)
            workers = 1 if world_size == 2 else workers
        stop = "kill9" if i == killed else rng.choices(STOPS, [55, 20, 25])[0]
        steps = rng.randint(1 if stop == "kill9" else 0, 14)
        legs.append(Leg(world_size, gb // world_size, workers, kind, steps, stop, mixture,
                        weights, rng.randrange(world_size), round(rng.random(), 2)))
    return tuple(legs)


def draw_weight(rng: random.Random) -> float | int:
    """A weight as people write them: 0.9, 0.25, 3, …"""
    return rng.choice([round(rng.uniform(0.05, 1), 2), rng.randint(1, 9), 0.5, 1])


def draw_phases(rng: random.Random, names: tuple[str, ...], first: int = 0) -> tuple:
    """1 to 3 phases from ``first`` (sorted starts, each with a non-empty set of stores)."""
    starts = sorted({first, *(first + rng.randint(1, 160) for _ in range(rng.randint(0, 2)))})
    return tuple((s, tuple((nm, draw_weight(rng)) for nm in
                           rng.sample(names, rng.randint(1, len(names))))) for s in starts)


def edit_phases(rng: random.Random, phases: tuple, names: tuple[str, ...],
                source: str = "store") -> tuple:
    """The next leg's phases: unchanged, respelled (every weight scaled: {a: 0.9, b: 0.1} →
    {a: 9, b: 1}), the future edited (phases from a later start redrawn), or the past edited."""
    what = rng.choices(["same", "respell", "future", "past"], [35, 20, 35, 10])[0]
    if what == "respell" and not (source == "stream" and
                                  "respelled stream phases" in KNOWN_FAILURES):
        k = rng.choice([10, 3, 0.5])
        return tuple((s, tuple((n, w * k) for n, w in ws)) for s, ws in phases)
    if what == "future":
        cut = rng.randint(1, 200)
        return tuple(p for p in phases if p[0] < cut) + draw_phases(rng, names, cut)[
            (1 if rng.random() < 0.3 else 0):]
    if what == "past":  # phase 0 draws otherwise: another store joins, or the first doubles
        s, ws = phases[0]
        missing = [n for n in names if n not in dict(ws)]
        ws = ws + ((missing[0], 1),) if missing else ((ws[0][0], 2 * ws[0][1]),) + ws[1:]
        return ((s, ws),) + phases[1:]
    return phases


def respelled(rng: random.Random, weights: tuple) -> tuple:
    """Fixed weights, the same or each scaled by one factor."""
    k = rng.choice([1, 1, 10, 0.5])
    if "respelled fixed weights" in KNOWN_FAILURES:
        k = 1
    return tuple(w * k for w in weights)


# ---- what is legal at a resume ------------------------------------------------------------------

def canonical(weights) -> tuple:
    """A phase's weights as what they draw: stores of weight > 0 and their ratios."""
    from fractions import Fraction
    ws = {n: Fraction(w).limit_denominator(10**6) for n, w in dict(weights).items() if w > 0}
    total = sum(ws.values())
    return tuple(sorted((n, w / total) for n, w in ws.items()))


def edit_is_legal(old: tuple, new: tuple, consumed: int) -> bool:
    """The promise of docs/mixing.md: phases that start after the checkpoint (at or after
    ``consumed``) may change; the earlier ones must stay as they were (respelled is the same)."""
    was = {s: canonical(ws) for s, ws in old if s < consumed}
    now = {s: canonical(ws) for s, ws in new if s < consumed}
    return was == now


# ---- loaders ------------------------------------------------------------------------------------

def open_loader(scn: Scenario, world: World, leg: Leg, rank: int, cache: Path | None,
                mixture: tuple | None, **changed):
    """One rank's loader of a leg (a store Loader or a streaming one), public API only;
    ``changed``: settings that differ from the scenario's."""
    common = dict(seq_len=scn.seq_len, batch_size=leg.batch_size, layout=scn.layout,
                  seed=scn.loader_seed, rank=rank, world_size=leg.world_size,
                  num_workers=leg.num_workers, max_segments=scn.max_segments,
                  **dict(scn.stream_options))
    common.update(changed)
    if common["max_segments"] is None or common["layout"] == "concat":
        del common["max_segments"]
    if common["layout"] == "concat":
        common.pop("pack_window", None)
    if scn.ints == "numpy":
        common = {k: numpy_int(v) for k, v in common.items()}
        mixture = mixture and tuple((numpy_int(s), ws) for s, ws in mixture)
    paths = world.texts if scn.source == "stream" else world.stores
    if scn.spelling == "one":
        source = [paths[scn.names[0]]] if scn.source == "stream" else paths[scn.names[0]]
    elif scn.spelling == "named":
        source = {n: paths[n] for n in scn.names}
        common["mixture"] = [(s, dict(ws)) for s, ws in mixture]
    else:
        source = {paths[n]: w for n, w in zip(scn.names, leg.weights)}
    if scn.source == "store":
        return Loader(source, worker_type=leg.worker_type, cache_dir=world.layout_cache, **common)
    return Loader.from_text(source, tokenizer="bytes", cache_dir=cache, **common)


def numpy_int(v):
    """An int as a numpy integer of the smallest width that holds it (others as they are)."""
    if isinstance(v, bool) or not isinstance(v, int):
        return v
    for t in (np.int8, np.int16, np.int32, np.int64, np.uint64):
        if np.iinfo(t).min <= v <= np.iinfo(t).max:
            return t(v)
    return v

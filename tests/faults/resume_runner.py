"""Running a resume scenario (``faults.resume_scenarios``): legs of loaders in lockstep, each
global batch compared with the rows of a run that never stopped, edits and unsafe changes
checked at each resume, one leg perhaps a training script killed with SIGKILL.

``check(scenario, world, tmp, replay=…)`` → its figures, or ``ScenarioFailed`` (the scenario's
one line and the command that replays it).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from faults.conftest import ScenarioFailed, watchdog
from faults.resume_scenarios import (Leg, Scenario, World, phases_of, edit_is_legal,
                                     open_loader)
from tokenmill.base.errors import ConfigError


class Reference:
    """Rows of a run that never stopped (one rank, the first leg's global batch, no workers),
    by global sample position, taken as far as asked."""

    def __init__(self, loader):
        self.loader, self.it, self.rows = loader, iter(loader), None

    def at(self, start: int, n: int) -> dict[str, np.ndarray]:
        """Rows [start, start + n) of every array."""
        while self.rows is None or len(next(iter(self.rows.values()))) < start + n:
            batch = next(self.it)
            self.rows = {k: np.array(v) if self.rows is None else
                         np.concatenate([self.rows[k], v]) for k, v in batch.items()}
        return {k: v[start:start + n] for k, v in self.rows.items()}

    def close(self) -> None:
        self.loader.close()


def first_difference(got: dict, want: dict, batch_size: int) -> str | None:
    """Where a global batch differs from the reference rows: key, row, rank; None if equal."""
    if got.keys() != want.keys():
        return f"keys {sorted(got)} != {sorted(want)}"
    for k in sorted(want):
        if got[k].shape != want[k].shape:
            return f"{k}: shape {got[k].shape} != {want[k].shape}"
        bad = np.flatnonzero((got[k] != want[k]).any(axis=1))
        if bad.size:
            return f"{k} row {bad[0]} (rank {bad[0] // batch_size}) differs"
    return None


# ---- running a scenario -------------------------------------------------------------------------

@dataclass
class Run:
    """What one scenario is running: its folder, the references by mixture, figures."""

    scn: Scenario
    world: World
    tmp: Path
    replay: str
    refs: dict
    figures: dict

    def fail(self, what: str) -> None:
        raise ScenarioFailed(f"resume scenario failed: {what}\n  scenario: {self.scn.line()}\n"
                             f"  replay: {self.replay}")

    def count(self, key: str, n: int = 1) -> None:
        self.figures[key] = self.figures.get(key, 0) + n

    def cache(self, leg: int, rank: int) -> Path:
        """The stream cache a leg's rank writes and reads."""
        name = {"shared": "cache", "per-leg": f"cache-leg{leg}",
                "per-rank": f"cache-rank{rank}"}[self.scn.cache]
        return self.tmp / name

    def reference(self, leg: Leg, mixture: tuple | None) -> Reference:
        """The uninterrupted run with this leg's mixture (or weights), opened once."""
        key = (mixture, leg.weights)
        if key not in self.refs:
            first = self.scn.legs[0]
            solo = dataclasses.replace(leg, world_size=1, num_workers=0, worker_type="thread",
                                       batch_size=first.batch_size * first.world_size)
            plain = dataclasses.replace(self.scn, ints="python")
            cache = self.tmp / f"reference-{len(self.refs)}"
            self.refs[key] = Reference(open_loader(plain, self.world, solo, 0, cache, mixture))
        return self.refs[key]


def check(scn: Scenario, world: World, tmp: Path, *, replay: str = "",
          timeout_s: float = 300) -> dict:
    """Run ``scn`` under ``tmp``; ScenarioFailed (the scenario's line, and ``replay``: the
    command that runs it again) if any promise broke; its figures."""
    run = Run(scn, world, tmp / f"scenario-{scn.seed}", replay, {}, {})
    run.tmp.mkdir(parents=True)
    try:
        with watchdog(timeout_s, scn.line()):
            state, mixture = None, scn.legs[0].mixture
            for i, leg in enumerate(scn.legs):
                if leg.change is not None and state is not None:
                    refuse_change(run, i, leg, mixture, state)
                if i and leg.mixture != mixture:
                    mixture = resume_edit(run, i, leg, mixture, state)
                if leg.stop == "kill9":
                    state = run_child_leg(run, i, leg, mixture, state)
                else:
                    state = run_leg(run, i, leg, mixture, state)
                run.count("resumes", i > 0)
    except ScenarioFailed:
        raise
    except Exception as e:  # the loader raised: the scenario failed, say which
        run.fail(f"{type(e).__name__}: {e}")
    finally:
        for ref in run.refs.values():
            ref.close()
        shutil.rmtree(run.tmp, ignore_errors=True)
    return run.figures


def consumed_of(state: dict | None) -> int:
    return 0 if state is None else int(state["consumed_samples"])


def resume_edit(run: Run, i: int, leg: Leg, mixture: tuple, state: dict | None) -> tuple:
    """The mixture leg ``i`` runs with: its edit if that is legal (the loader must accept it),
    else the one in force (the loader must have refused the edit, naming a phase)."""
    legal = edit_is_legal(mixture, leg.mixture, consumed_of(state))
    if legal:
        run.count("edits accepted")
        return leg.mixture
    with open_loader(run.scn, run.world, leg, 0, run.cache(i, 0), leg.mixture) as ld:
        try:
            ld.load_state_dict(json.loads(json.dumps(state)))
        except ConfigError as e:
            if "phase" not in str(e):
                run.fail(f"leg {i}: an edit of a consumed phase was refused without naming the "
                         f"phase: {e}")
            run.count("edits refused")
            return mixture
    run.fail(f"leg {i}: an edit of a phase before the checkpoint (consumed "
             f"{consumed_of(state)}) was accepted: {list(mixture)} → {list(leg.mixture)}")


def refuse_change(run: Run, i: int, leg: Leg, mixture: tuple | None, state: dict) -> None:
    """A resume with another seq_len, seed, layout, … must be refused, naming the setting."""
    key, value = leg.change
    with open_loader(run.scn, run.world, leg, 0, run.cache(i, 0), mixture, **{key: value}) as ld:
        try:
            ld.load_state_dict(json.loads(json.dumps(state)))
        except ConfigError as e:
            if key not in str(e):
                run.fail(f"leg {i}: a resume with {key}={value!r} was refused without naming "
                         f"{key}: {e}")
            run.count("unsafe changes refused")
            return
    run.fail(f"leg {i}: a resume with {key}={value!r} (the state's run had another) was accepted")


def open_leg(run: Run, i: int, leg: Leg, mixture: tuple | None, state: dict | None) -> list:
    """The leg's loaders, one per rank, each given a JSON round trip of ``state``."""
    loaders = []
    try:
        for r in range(leg.world_size):
            loaders.append(open_loader(run.scn, run.world, leg, r, run.cache(i, r), mixture))
            if state is not None:
                try:
                    loaders[-1].load_state_dict(json.loads(json.dumps(state)))
                except ConfigError as e:
                    run.fail(f"leg {i} rank {r}: a resume that changes nothing but safe "
                             f"settings was refused: {e}")
    except BaseException:
        for ld in loaders:
            ld.close()
        raise
    return loaders


def run_leg(run: Run, i: int, leg: Leg, mixture: tuple | None, state: dict | None) -> dict:
    """Leg ``i`` in this process, ranks in lockstep; the state the next leg loads."""
    ref, gb = run.reference(leg, mixture), leg.batch_size * leg.world_size
    consumed = consumed_of(state)
    loaders = open_leg(run, i, leg, mixture, state)
    try:
        if any(ld.consumed_samples != consumed for ld in loaders):
            run.fail(f"leg {i}: consumed_samples after load is "
                     f"{[ld.consumed_samples for ld in loaders]}, the state says {consumed}")
        states = [saved_state(run, i, loaders)]
        its = [iter(ld) for ld in loaders]
        for step in range(leg.steps):
            if leg.stop == "reiter":  # a new iterator every step retires the last one
                its = [iter(ld) for ld in loaders]
            batch = global_batch([next(it) for it in its])
            if (diff := first_difference(batch, ref.at(consumed, gb), leg.batch_size)):
                run.fail(f"leg {i} step {step} (global samples {consumed}…{consumed + gb - 1}): "
                         f"{diff} from the uninterrupted run's")
            consumed += gb
            run.count("global batches compared")
            if leg.stop == "rewind":
                states.append(saved_state(run, i, loaders))
        if leg.stop == "rewind":
            return states[int(leg.rewind * (len(states) - 1))]
        return saved_state(run, i, loaders, leg.state_rank)
    finally:
        for ld in loaders:
            ld.close()


def saved_state(run: Run, i: int, loaders: list, rank: int = 0) -> dict:
    """``rank``'s state_dict, through JSON; every rank must save the same position."""
    states = [json.loads(json.dumps(ld.state_dict())) for ld in loaders]
    at = {s["consumed_samples"] for s in states}
    if len(at) != 1:
        run.fail(f"leg {i}: the ranks' states disagree on consumed_samples: {sorted(at)}")
    return states[rank]


def global_batch(parts: list[dict]) -> dict[str, np.ndarray]:
    """The ranks' batches put together in rank order (copied: loaders reuse their buffers)."""
    return {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in parts[0]}


# ---- a leg in a child process, killed with SIGKILL ----------------------------------------------

def run_child_leg(run: Run, i: int, leg: Leg, mixture: tuple | None, state: dict | None) -> dict:
    """Leg ``i`` as a training script (tests/faults/programs.py ``fuzz_leg``: a checkpoint after
    every step, a digest of every rank's batch logged), kill -9'd once it has logged
    ``leg.steps`` steps: every logged batch must be the uninterrupted run's, nothing may be left
    behind, and the next leg resumes from the script's last checkpoint."""
    from faults.conftest import assert_nothing_left, child_env, program
    from faults.programs import read_log
    files = {k: run.tmp / f"leg{i}.{k}" for k in ("in.json", "ckpt.json", "log", "tmp")}
    if state is not None:
        files["in.json"].write_text(json.dumps(state))
    args = {"scenario": run.scn.to_json(), "world": dataclasses.asdict(run.world), "leg": i,
            "mixture": mixture, "state": str(files["in.json"]) if state is not None else None,
            "ckpt": str(files["ckpt.json"]), "log": str(files["log"]),
            "caches": [str(run.cache(i, r)) for r in range(leg.world_size)]}
    proc = subprocess.Popen(program("fuzz_leg", json.dumps(args)), env=child_env(files["tmp"]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    kids, shm, alive = kill_after(run, i, proc, files["log"], leg.steps)
    err = proc.stderr.read()
    proc.stderr.close()
    if not alive:
        run.fail(f"leg {i}: the child ended before its kill (exit {proc.returncode}): "
                 f"{err.strip().splitlines()[-1:] or ''}")
    try:
        assert_nothing_left(kids, shm, files["tmp"], what=f"leg {i}, after kill -9: ")
    except AssertionError as e:
        run.fail(str(e).splitlines()[0])
    logged = [e for e in read_log(files["log"]) if "c" in e]
    check_logged(run, i, leg, mixture, logged)
    run.count("kill -9")
    if files["ckpt.json"].exists():
        return json.loads(files["ckpt.json"].read_text())
    return state


def kill_after(run: Run, i: int, proc: subprocess.Popen, log: Path, steps: int):
    """SIGKILL ``proc`` once ``log`` holds ``steps`` steps (stopped first, so that its processes
    and shared memory are listed at the moment it dies): (its descendants, their /dev/shm names,
    whether it was still running)."""
    from faults.conftest import stop_and_kill
    from faults.programs import read_log
    deadline = time.monotonic() + 120
    try:
        while sum("c" in e for e in read_log(log)) < steps and proc.poll() is None:
            if time.monotonic() > deadline:
                run.fail(f"leg {i}: the child logged fewer than {steps} steps in 120 s (a hang?)")
            time.sleep(0.005)
    finally:
        kids, shm, alive = stop_and_kill(proc)
    return kids, shm, alive


def check_logged(run: Run, i: int, leg: Leg, mixture: tuple | None, logged: list[dict]) -> None:
    """Every batch the killed child logged is its rank's slice of the uninterrupted run's."""
    from faults.programs import digest
    ref, b = run.reference(leg, mixture), leg.batch_size
    for step, e in enumerate(logged):
        rows = ref.at(e["c"], b * leg.world_size)
        want = [digest({k: np.ascontiguousarray(v[r * b:(r + 1) * b]) for k, v in rows.items()})
                for r in range(leg.world_size)]
        if e["h"] != want:
            bad = next(r for r in range(leg.world_size) if e["h"][r] != want[r])
            run.fail(f"leg {i} (child, kill -9) step {step} (global samples from {e['c']}): "
                     f"rank {bad}'s batch differs from the uninterrupted run's")
        run.count("global batches compared")


def child_leg(a: dict, log, digest) -> None:
    """The child's side of ``run_child_leg``: ranks in lockstep, forever; after every step the
    digests of the ranks' batches go to ``log`` and the state to the checkpoint (atomically)."""
    from tokenmill.base.io import atomic_write_json
    scn, world = Scenario.from_json(a["scenario"]), World(**{
        **a["world"], "mixable": tuple(a["world"]["mixable"]),
        "seq_lens": tuple(a["world"]["seq_lens"])})
    leg = scn.legs[a["leg"]]
    loaders = [open_loader(scn, world, leg, r, Path(a["caches"][r]), phases_of(a["mixture"]))
               for r in range(leg.world_size)]
    if a["state"] is not None:
        state = json.loads(Path(a["state"]).read_text())
        for ld in loaders:
            ld.load_state_dict(state)
    its = [iter(ld) for ld in loaders]
    while True:
        consumed = loaders[0].consumed_samples
        log(c=consumed, h=[digest(next(it)) for it in its])
        atomic_write_json(a["ckpt"], loaders[leg.state_rank].state_dict())

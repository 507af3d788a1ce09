"""Input files that change while prepare reads them, and files that are not regular files.

Real prepare processes (the CLI, or a script file as a user writes one) on real files. A run is
stopped at a known record by a transform that waits there (it touches ``paused`` and waits for
``go``), the input is changed, and the run goes on: it must fail naming the file, and write no
manifest — never a store holding part of one version and part of another.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import docs_of
from tokenmill.prepare import prepare

LINE = 100  # every record's line is exactly this long: record i starts at byte i * LINE
UNIT = 4000  # unit_bytes of the script runs: 40 records a unit
PAUSE_AT = 12 * UNIT // LINE + 5  # a record of unit 12: past the 9 units a read-ahead thread
#                                   may read before the run has planned (so its plan is in place)

HOOK = '''
import os
import time
from pathlib import Path


def pause(record):
    """The record's text; at record PAUSE_AT (once): touch "paused", wait for "go"."""
    here = Path(os.environ["PAUSE_DIR"])
    if record["i"] == int(os.environ["PAUSE_AT"]) and not (here / "go").exists():
        (here / "paused").touch()
        deadline = time.monotonic() + 120
        while not (here / "go").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the test never said go")
            time.sleep(0.001)
    return record["text"]
'''

RUN_PREPARE = """
import json, sys
from tokenmill import prepare
prepare(sys.argv[1], progress=False, **json.loads(sys.argv[2]))
"""


def records(n: int, fill: str = "x") -> bytes:
    """n JSONL records of exactly LINE bytes each: {"i": i, "text": "<i> xxx…"}."""
    out = []
    for i in range(n):
        head = json.dumps({"i": i, "text": f"{i:06d} "})[:-2]
        out.append(f'{head}{fill * (LINE - len(head) - 3)}"}}\n')
    data = "".join(out).encode()
    assert len(data) == n * LINE
    return data


@pytest.fixture
def site(tmp_path):
    """A working folder: the pausing transform in mods/, x.jsonl of 1,200 records (30 units)."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "hook.py").write_text(HOOK)
    (tmp_path / "run_prepare.py").write_text(RUN_PREPARE)
    (tmp_path / "x.jsonl").write_bytes(records(1200))
    return tmp_path


def env_of(site: Path) -> dict:
    """The environment of a run in ``site``: the hook importable, where and when it pauses."""
    path = os.pathsep.join([str(site / "mods"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "PAUSE_DIR": str(site),
            "PAUSE_AT": str(PAUSE_AT)}


def paused_run(site: Path, argv: list[str], change) -> subprocess.CompletedProcess:
    """Run ``argv`` in ``site``; once it waits at record PAUSE_AT, ``change(site / "x.jsonl")``,
    then let it go on; its result."""
    proc = subprocess.Popen(argv, cwd=site, env=env_of(site), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (site / "paused").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never reached the record"
            time.sleep(0.002)
        change(site / "x.jsonl")
        (site / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def replaced(path: Path) -> None:
    """`mv new.jsonl x.jsonl`: other text of the very same size, renamed over the input."""
    new = path.with_name("new.jsonl")
    new.write_bytes(records(1200, fill="N"))
    os.replace(new, path)


def truncated(path: Path) -> None:
    """The input cut in place at 60 %, inside a line (a job rewriting it)."""
    os.truncate(path, 720 * LINE + 37)


def script(workers: int) -> list[str]:
    """prepare("x.jsonl", …) run by a script file: small units, the pausing transform."""
    options = {"out": "store", "workers": workers, "unit_bytes": UNIT, "shard_tokens": 2000,
               "transform": "hook:pause"}
    return [sys.executable, "run_prepare.py", "x.jsonl", json.dumps(options)]


CHANGED = "x.jsonl: the file changed while it was being read (replaced, truncated or rewritten: "


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("change, how", [(replaced, "another file was put in its place"),
                                         (truncated, "size 120,000 → 72,037 bytes")])
def test_an_input_changed_while_prepare_reads_it_fails_naming_it(site, workers, change, how):
    r = paused_run(site, script(workers), change)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last == f"tokenmill.errors.InputError: {CHANGED}{how}); run again once it is stable"
    assert not (site / "store" / "manifest.json").exists()


def test_the_cli_says_in_one_line_which_input_changed(site):
    """`tokenmill prepare` with 2 workers (4 MiB units) over an input truncated mid-run."""
    (site / "x.jsonl").write_bytes(records(130_000))  # 13 MB: 4 units
    argv = [sys.executable, "-m", "tokenmill", "prepare", "x.jsonl", "--out", "store",
            "--workers", "2", "--transform", "hook:pause"]
    r = paused_run(site, argv, lambda p: os.truncate(p, 6_000_000 + 37))
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [f"tokenmill prepare: error: {CHANGED}size 13,000,000 → "
                                     "6,000,037 bytes); run again once it is stable"]
    assert not (site / "store" / "manifest.json").exists()


def test_after_the_error_a_rerun_on_the_stable_file_gives_the_store_of_its_new_text(site):
    """The advice holds: the same command again gives the store of the file as it is now (the
    shards committed from the earlier version are checked against it by their input digests)."""
    r = paused_run(site, script(2), replaced)
    assert r.returncode == 1 and list((site / "store" / ".progress").glob("shard-*.json"))
    rerun = subprocess.run(script(2), cwd=site, env=env_of(site), capture_output=True, text=True,
                           timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    fresh = prepare(str(site / "x.jsonl"), out=site / "fresh", workers=1, progress=False,
                    unit_bytes=UNIT, shard_tokens=2000)
    assert docs_of(site / "store") == docs_of(site / "fresh") and fresh["num_documents"] == 1200


def test_a_resume_after_a_size_change_is_refused_until_overwrite(site):
    """The file's size changed: the rerun refuses the unfinished run, saying so, until
    --overwrite; then it gives the store of the new text."""
    r = paused_run(site, script(2), truncated)
    assert r.returncode == 1 and list((site / "store" / ".progress").glob("shard-*.json"))
    (site / "x.jsonl").write_bytes(records(720))  # whole lines again: a valid, stable file
    rerun = subprocess.run(script(2), cwd=site, env=env_of(site), capture_output=True, text=True,
                           timeout=120)
    assert rerun.returncode == 1
    last = rerun.stderr.strip().splitlines()[-1]
    assert "holds an unfinished prepare with other settings (input files changed: " in last
    assert "x.jsonl: 120000 → 72000 bytes); an input changed since: pass --overwrite" in last
    assert not (site / "store" / "manifest.json").exists()
    over = subprocess.run([*script(2)[:-1], json.dumps({**json.loads(script(2)[-1]),
                                                        "overwrite": True})],
                          cwd=site, env=env_of(site), capture_output=True, text=True, timeout=120)
    assert over.returncode == 0, over.stderr
    assert [bytes(d[:-1]) for d in docs_of(site / "store")] == [
        json.loads(line)["text"].encode() for line in records(720).splitlines()]

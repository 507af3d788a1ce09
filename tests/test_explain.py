"""``tokenmill explain`` reads the store only, and explains the run that happened (issue 22.7).

What a document's number counts (a line, a row, an element of a .json array) is recorded by
prepare in the manifest (``source_kinds``): explain never opens an input again — a moved or
rewritten input changes nothing, and a URL a crafted manifest names receives no request. The
command takes every setting that shaped the run's batches from a state (``--state``) or from
flags, and refuses, in one line, what it cannot know (weights of unnamed stores, max_segments,
seed, …), where it assumed them before.
"""

from __future__ import annotations

import csv
import gzip
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import ClassVar

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tokenmill
from tokenmill.cli import main
from tokenmill.base.io import json_bytes
from tokenmill.load.loader import Loader
from tokenmill.store.format import MANIFEST_CHECKSUM, SOURCE_KINDS, SOURCES, manifest_checksum

L, B = 16, 4
KINDS = {"a.jsonl": "line", "c.jsonl.gz": "line", "e.json": "line", "g.json": "element",
         "b.parquet": "row", "f.csv": "row", "t.tsv": "row", "x.txt": "line"}
PACKED = dict(layout="packed", max_segments=2, seed=3, world_size=2)  # the training run's


def text_of(i: int, tag: str) -> str:
    """A document naming its file and number, of varied length."""
    return f"<{tag}{i}>" + "".join(chr(97 + (i * 7 + k) % 26) for k in range((i * 13) % 41))


def write_inputs(d: Path) -> None:
    """One file of each kind: lines (.jsonl, .jsonl.gz, a JSON-Lines .json, .txt), rows (.parquet,
    .csv, .tsv) and the elements of a .json array."""
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps({"text": text_of(i, "j")}) + "\n"
                                       for i in range(40)))
    with gzip.open(d / "c.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": text_of(i, "z")}) + "\n" for i in range(30))
    (d / "e.json").write_text("".join(json.dumps({"text": text_of(i, "e")}) + "\n"
                                      for i in range(40)))
    (d / "g.json").write_text(json.dumps([{"text": text_of(i, "g")} for i in range(40)], indent=1))
    pq.write_table(pa.table({"text": [text_of(i, "p") for i in range(30)]}), str(d / "b.parquet"),
                   row_group_size=7)
    for name, delimiter in (("f.csv", ","), ("t.tsv", "\t")):
        with open(d / name, "w", newline="") as f:
            w = csv.writer(f, delimiter=delimiter)
            w.writerow(["id", "text"])
            w.writerows((i, text_of(i, name[0])) for i in range(30))
    (d / "x.txt").write_text("".join(text_of(i, "x") + "\n" for i in range(30)))


def prepare(inputs: Path, out: Path) -> dict:
    return tokenmill.prepare([str(inputs)], out=str(out), tokenizer="bytes", txt_mode="lines",
                             unit_bytes=400, shard_tokens=1200, workers=1, progress=False)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A folder holding ``in/`` (every kind of input) and ``store/`` prepared from it."""
    root = tmp_path_factory.mktemp("explain")
    write_inputs(root / "in")
    prepare(root / "in", root / "store")
    return root


@pytest.fixture
def fresh(tmp_path) -> Path:
    """Like ``made``, the test's own (it may move the inputs and edit the manifest)."""
    write_inputs(tmp_path / "in")
    prepare(tmp_path / "in", tmp_path / "store")
    return tmp_path


def edit_manifest(store: Path, edit) -> None:
    """Change a store's manifest and recompute its checksum: what a crafted store does."""
    manifest = json.loads((store / "manifest.json").read_text())
    edit(manifest)
    manifest[MANIFEST_CHECKSUM] = manifest_checksum(manifest)
    (store / "manifest.json").write_bytes(json_bytes(manifest))


def tm(*args) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "tokenmill", *map(str, args)],
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr


def explained(store: Path, steps=(0, 1), batch_size: int = 48) -> list[str]:
    """The lines ``tokenmill explain`` prints for each step (the concat run of seed 0), each in a
    fresh process."""
    out = []
    for step in steps:
        code, stdout, err = tm("explain", store, "--step", step, "--seq-len", L, "--batch-size",
                               batch_size, "--seed", 0, "--layout", "concat", "--world-size", 1)
        assert code == 0, err
        out += stdout.splitlines()
    return out


def sources_of(lines: list[str]) -> list[str]:
    return [line.split("  ")[-1] for line in lines]


def test_prepare_and_the_streaming_cache_record_what_each_files_numbers_count(made, tmp_path):
    manifest = json.loads((made / "store" / "manifest.json").read_text())
    got = {os.path.basename(f): k for f, k in zip(manifest[SOURCES], manifest[SOURCE_KINDS])}
    assert got == KINDS  # the two .json files told apart by their content, once, at prepare
    with Loader.from_text(str(made / "in"), tokenizer="bytes", txt_mode="lines", unit_bytes=400,
                          shard_tokens=1200, seq_len=L, batch_size=B, num_workers=0,
                          cache_dir=tmp_path / "cache") as ld:
        it = iter(ld)
        while not (ld.store_path / "manifest.json").exists():
            next(it)
        cached = json.loads((ld.store_path / "manifest.json").read_text())
    assert cached[SOURCES] == manifest[SOURCES] and cached[SOURCE_KINDS] == manifest[SOURCE_KINDS]


def test_explain_gives_the_same_answer_after_the_inputs_moved_or_were_rewritten(fresh):
    store = fresh / "store"
    before = explained(store)
    assert any(" element " in s and "g.json" in s for s in sources_of(before))
    assert any(s.endswith(tuple(f"e.json:{n}" for n in range(1, 41))) for s in sources_of(before))
    os.rename(fresh / "in", fresh / "moved")  # was: "…/g.json:12", a line, once g.json was gone
    assert explained(store) == before
    (fresh / "in").mkdir()  # the .json files come back with the other layout each
    (fresh / "in" / "g.json").write_text((fresh / "moved" / "e.json").read_text())
    (fresh / "in" / "e.json").write_text((fresh / "moved" / "g.json").read_text())
    assert explained(store) == before


class Requests(http.server.BaseHTTPRequestHandler):
    """Counts every request that reaches the server (and answers a .json array)."""

    seen: ClassVar[list[str]] = []

    def do_GET(self):
        self.seen.append(f"{self.command} {self.path}")
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(b"[]")

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Requests)
    Requests.seen = []
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("kinds", ["recorded", "not recorded"])
def test_explain_never_opens_a_url_a_crafted_manifest_names(fresh, server, kinds):
    store = fresh / "store"
    base = f"http://127.0.0.1:{server.server_port}"

    def craft(m):
        m[SOURCES] = [f"{base}/{os.path.basename(f)}" for f in m[SOURCES]]
        if kinds == "not recorded":
            m.pop(SOURCE_KINDS, None)
    edit_manifest(store, craft)
    lines = explained(store)
    assert Requests.seen == []  # was GET /g.json, /e.json for every .json piece
    sources = sources_of(lines)
    assert all(s.startswith(base + "/") for s in sources)
    json_pieces = [s for s in sources if ".json" in s and ".jsonl" not in s]
    assert json_pieces  # the URL is printed, never opened
    if kinds == "recorded":
        assert any(f"{base}/g.json element " in s for s in json_pieces)
    else:  # a .json's kind was decided by its content, which explain does not read
        assert all(s.endswith(" (source kind unknown)") and " #" in s for s in json_pieces)


def test_a_store_made_before_kinds_were_recorded_names_by_extension_and_reads_no_input(fresh):
    store = fresh / "store"
    edit_manifest(store, lambda m: m.pop(SOURCE_KINDS, None))
    os.rename(fresh / "in", fresh / "moved")
    kinds = set()
    with Loader(str(store), seq_len=L, batch_size=B, num_workers=0) as ld:
        for step in range(len(ld)):
            for p in (p for o in ld.explain(step) for p in o.pieces):
                name = os.path.basename(p.file)
                kinds.add(name)
                if name.endswith(".json"):  # was "…/g.json:5", though g.json holds an array
                    assert p.source == f"{p.file} #{p.line} (source kind unknown)", p
                    assert p.kind is None
                else:
                    want = {"line": f"{p.file}:{p.line}", "row": f"{p.file} row {p.line}"}
                    assert p.kind == KINDS[name] and p.source == want[p.kind], p
    assert kinds == set(KINDS)


# ---- the command explains the run that happened --------------------------------------------

@pytest.fixture(scope="module")
def run(made, tmp_path_factory) -> dict:
    """A second store, and the state of a packed run of two unnamed stores weighted 0.6/0.4 on
    rank 1 of 2, saved after 3 steps; what that run's Loader explains for steps 0, 3, 5, 40."""
    root = tmp_path_factory.mktemp("run")
    (root / "in2").mkdir()
    (root / "in2" / "k.jsonl").write_text("".join(json.dumps({"text": text_of(i, "k") * 3})
                                                  + "\n" for i in range(60)))
    prepare(root / "in2", root / "other")
    stores = [str(made / "store"), str(root / "other")]
    want = {}
    with Loader(dict(zip(stores, [0.6, 0.4])), seq_len=L, batch_size=B, rank=1, num_workers=0,
                **PACKED) as ld:
        it = iter(ld)
        for _ in range(3):
            next(it)
        (root / "state.json").write_text(json.dumps(ld.state_dict()))
        for step in (0, 3, 5, 40):
            want[step] = [(str(o.row), o.store, f"{o.draw:,}", p.source) for o in ld.explain(step)
                          for p in o.pieces]
    assert {s for rows in want.values() for _, s, _, _ in rows} == set(stores)
    return {"stores": stores, "state": str(root / "state.json"), "want": want, "root": root}


def rows_of(stdout: str) -> list[tuple[str, ...]]:
    """(row, store, draw, source) of each line ``tokenmill explain`` prints."""
    fields = [line.split("  ") for line in stdout.splitlines()]
    return [(f[0].split()[1], f[2].split(" ", 1)[1], f[3].split()[1], f[-1]) for f in fields]


def test_explain_with_the_runs_state_gives_the_runs_rows(run):
    for step, want in run["want"].items():  # was: --state unknown; weights taken as equal
        code, out, err = tm("explain", *run["stores"], "--state", run["state"], "--step", step,
                            "--rank", 1)
        assert code == 0 and err == "", err
        assert rows_of(out) == want, step
    # the same run with every setting given instead
    code, out, err = tm("explain", *run["stores"], "--step", 5, "--rank", 1, "--seq-len", L,
                        "--batch-size", B, "--layout", "packed", "--max-segments", 2, "--seed", 3,
                        "--world-size", 2, "--weights", "0.6,0.4")
    assert code == 0 and rows_of(out) == run["want"][5], err


def refusal(capsys, *args) -> str:
    """The one line ``tokenmill explain`` refuses with (exit 2)."""
    code = main(["explain", *map(str, args)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    return err.removeprefix("tokenmill explain: error: ").strip()


def test_explain_refuses_what_it_cannot_know_in_one_line(run, capsys, tmp_path):
    a, b = run["stores"]
    flags = ["--step", 5, "--seq-len", L, "--batch-size", B]
    every = [*flags, "--seed", 3, "--world-size", 2]
    # was exit 0: equal weights assumed for unnamed stores, no cap on segments, seed 0, 1 rank
    assert refusal(capsys, a, b, *every, "--layout", "concat") == (
        "missing --weights: pass each setting that shaped the run's batches (none is assumed), "
        "or --state STATE.json (the run's Loader.state_dict() saved as JSON)")
    assert refusal(capsys, a, b, *every, "--layout", "packed", "--max-segments", 2) \
        .startswith("missing --weights: ")
    assert refusal(capsys, a, b, *every, "--layout", "packed", "--weights", "0.6,0.4") \
        .startswith("missing --max-segments: ")
    assert refusal(capsys, a, *flags).startswith("missing --layout, --seed, --world-size: ")
    assert refusal(capsys, a, b, *every, "--layout", "concat", "--weights", "1,2,3") == \
        "3 weights for 2 stores: give one weight a store, in the order of the stores"
    assert refusal(capsys, a, b, *every, "--layout", "concat", "--weights", "0.9,x") \
        .startswith("--weights '0.9,x' is not a list of numbers")
    assert refusal(capsys, f"web={a}", f"code={b}", *every, "--layout", "concat",
                   "--weights", "1,1", "--mixture", '[[0, {"web": 1, "code": 1}]]') \
        .startswith("fixed weights are for unnamed stores")
    # a state is taken for its own run only
    state = ["--state", run["state"], "--step", 5, "--rank", 1]
    assert refusal(capsys, a, b, *state, "--seed", 4).endswith("seed 3 → 4")
    assert "stores [" in refusal(capsys, b, a, *state)
    assert "stores [" in refusal(capsys, a, a, *state)
    saved = json.loads(Path(run["state"]).read_text())
    old = tmp_path / "old.json"  # the three-key form records no settings
    old.write_text(json.dumps({k: saved[k] for k in ("version", "consumed_samples",
                                                     "fingerprint")}))
    assert refusal(capsys, a, b, "--state", old, "--step", 5) == (
        f"{old} does not record --seq-len, --batch-size, --layout, --seed, --world-size, "
        "--weights: pass them as the run had them")
    assert "fingerprint" in refusal(capsys, a, b, "--state", old, "--step", 5, *every[2:],
                                    "--layout", "concat", "--weights", "0.6,0.4")
    stream = tmp_path / "stream.json"
    stream.write_text(json.dumps({"version": 1, "mode": "stream", "consumed_samples": 8,
                                  "fingerprint": "x"}))
    assert refusal(capsys, a, "--state", stream, "--step", 0) == (
        f"{stream}: a streaming loader's state (mode 'stream'); explain explains a Loader over "
        "stores: pass a Loader's state")


def test_a_packed_row_no_document_reached_is_shown_as_padding(tmp_path):
    # 2-token documents at seq_len 1 fill a row each and the plan allots about twice as many
    # rows: the rest are all padding. explain said nothing of them (each row's pieces printed)
    from conftest import write_positional_store
    store = write_positional_store(tmp_path / "s", [2] * 300)
    with Loader(store, seq_len=1, batch_size=8, layout="packed", num_workers=0) as ld:
        origins = ld.explain(0)
    empty = [o for o in origins if not o.pieces]
    assert empty and len(origins) == 8
    code, out, err = tm("explain", store, "--step", 0, "--seq-len", 1, "--batch-size", 8,
                        "--layout", "packed", "--seed", 0, "--world-size", 1,
                        "--max-segments", "none")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 8  # one a row: its one document, or that it is padding
    for o in empty:
        assert f"row {o.row}  sample {o.position:,}  store" in "\n".join(
            line for line in lines if "padding only: no document in this row" in line)

"""prepare's transform (record → text) and validation split, end to end through the real CLI.

Every store here uses the byte tokenizer, so a document decodes back to its exact text.
"""

import csv
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import byte_texts, docs_of, kill_after_first_commit, store_bytes, write_jsonl
from tokenmill.base.errors import ConfigError
from tokenmill.prepare import prepare
from tokenmill.prepare.split import is_val, keep_side, kept_indices
from tokenmill.inputs.records import Skip

TOKENMILL = Path(sys.executable).with_name("tokenmill")  # the venv's console script
EOS = 256

TRANSFORMS = '''
import os
import time


def chat(record):
    """A chat template; records flagged "drop" are dropped."""
    if os.environ.get("SLOW_TRANSFORM"):
        time.sleep(0.002)
    if record.get("drop"):
        return None
    if "q" not in record:
        return "plain: " + record["text"]
    return "<user> " + record["q"] + " <bot> " + record["a"]


def short_dropped(record):
    """A .txt document of fewer than 40 characters is dropped."""
    return None if len(record["text"]) < 40 else record["text"]


def boom(record):
    if record["q"].endswith("7"):
        raise KeyError("no such field")
    return record["q"]
'''


def digests(store) -> set[str]:
    """A hash of every document of a store."""
    return {hashlib.sha256(bytes(d[:-1])).hexdigest() for d in docs_of(store)}


def records(n: int, start: int = 0) -> list[dict]:
    """n distinct chat records; every 5th is flagged drop."""
    return [{"q": f"question {i}", "a": f"answer {i} " * (i % 4 + 1), "drop": i % 5 == 3}
            for i in range(start, start + n)]


def write_records(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def expected(rows: list[dict]) -> list[str]:
    """What the chat transform makes of rows (None dropped)."""
    return ["<user> " + r["q"] + " <bot> " + r["a"] for r in rows if not r["drop"]]


@pytest.fixture
def site(tmp_path):
    """A working folder with a transform module in mods/, on PYTHONPATH for the CLI."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "fmt.py").write_text(TRANSFORMS)
    return tmp_path


def cli(site: Path, *args, env=None, wait=True):
    """The real `tokenmill` command in ``site``, its transform module on PYTHONPATH."""
    path = os.pathsep.join([str(site / "mods"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path, **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}  # None: unset
    argv = [str(TOKENMILL), *map(str, args)]
    if not wait:
        return subprocess.Popen(argv, cwd=site, env=env, stderr=subprocess.DEVNULL)
    return subprocess.run(argv, cwd=site, capture_output=True, text=True, env=env, timeout=120)


RUN_PREPARE = """
import json, sys
from tokenmill import prepare
prepare(*json.loads(sys.argv[1]), progress=False, **json.loads(sys.argv[2]))
"""


def script(site: Path, out: str, wait=True, env=None, inputs="x.jsonl", **options):
    """prepare(inputs, out=out, **options) run by a script file in ``site`` (small units: an
    interrupted run leaves some committed, some not)."""
    (site / "run_prepare.py").write_text(RUN_PREPARE)
    options = {"workers": 2, "unit_bytes": 2000, "shard_tokens": 2000, **options}
    path = os.pathsep.join([str(site / "mods"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    argv = [sys.executable, "run_prepare.py", json.dumps([inputs]),
            json.dumps({"out": out, **options})]
    if not wait:
        return subprocess.Popen(argv, cwd=site, env=env, stderr=subprocess.DEVNULL)
    return subprocess.run(argv, cwd=site, capture_output=True, text=True, env=env, timeout=120)


# ---- transform -------------------------------------------------------------------------------

def test_the_stores_documents_are_the_transforms_output_and_drops_are_counted(site):
    rows = records(80)
    (site / "in").mkdir()
    write_records(site / "in" / "a.jsonl", rows[:40])
    pq.write_table(pa.Table.from_pylist(rows[40:60]), site / "in" / "b.parquet", row_group_size=7)
    (site / "in" / "c.txt").write_text("a whole text file")
    with gzip.open(site / "in" / "d.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows[60:70]))
    table = pa.Table.from_pylist(rows[70:])
    with pa.ipc.new_stream(site / "e.arrow", table.schema) as w:  # a file named: always read
        w.write_table(table, max_chunksize=3)
    for workers in (1, 2):
        r = cli(site, "prepare", "in", "e.arrow", "--out", f"s{workers}", "--transform",
                "fmt:chat", "--workers", workers)
        assert r.returncode == 0, r.stderr
        assert "dropped_by_transform 16" in r.stderr, r.stderr
    assert byte_texts(site / "s1") == (expected(rows[70:]) + expected(rows[:60]) +  # path order
                                     ["plain: a whole text file"] + expected(rows[60:70]))
    assert store_bytes(site / "s1") == store_bytes(site / "s2")
    m = json.loads((site / "s1" / "manifest.json").read_text())
    assert m["skipped"]["by_reason"] == {"dropped_by_transform": 16}
    assert m["settings"]["transform"].startswith("fmt:chat (source xxh3 ")
    assert [(e["path"], e["where"]) for e in m["skipped"]["examples"][:3]] == [
        ("e.arrow", "row 4 (record batch 1)"), ("e.arrow", "row 9 (record batch 2)"),
        ("in/a.jsonl", "line 4")]
    assert m["skipped"]["examples"][0]["detail"] == "fmt:chat returned None"
    plain = cli(site, "prepare", "in/a.jsonl", "--out", "plain", "--text-key", "q")
    assert plain.returncode == 0 and "transform" not in json.loads(
        (site / "plain" / "manifest.json").read_text())["settings"]


def test_a_module_in_the_current_folder_is_found_by_the_cli(site):
    (site / "fmt_here.py").write_text("def q(record):\n    return record['q'].upper()\n")
    write_records(site / "x.jsonl", records(3))
    r = cli(site, "prepare", "x.jsonl", "--out", "s", "--transform", "fmt_here:q", "--workers", 2)
    assert r.returncode == 0, r.stderr
    assert byte_texts(site / "s") == ["QUESTION 0", "QUESTION 1", "QUESTION 2"]


def test_a_transform_the_workers_cannot_import_is_refused_with_what_to_do(site, tmp_path):
    write_records(site / "x.jsonl", records(3))
    script = site / "prep.py"  # a user's script, no __main__ guard
    script.write_text("import tokenmill\n\ndef to_text(r):\n    return r['q']\n\n"
                      "tokenmill.prepare('x.jsonl', out='s', transform=to_text, workers=2)\n")
    r = subprocess.run([sys.executable, str(script)], cwd=site, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0
    assert "transform to_text is defined in the script that was run (__main__)" in r.stderr
    assert "move it into a module of its own" in r.stderr
    for fn in (lambda r: r["q"], nested()):
        with pytest.raises(ConfigError, match="is a lambda, a nested function"):
            prepare(site / "x.jsonl", out=tmp_path / "t", transform=fn, progress=False)
    for spec, says in [("fmt", "must be 'module:function'"), ("nomod:f", "cannot import module"),
                       ("fmt:nothing", "module 'fmt' has no 'nothing'")]:
        r = cli(site, "prepare", "x.jsonl", "--out", "s", "--transform", spec)
        assert r.returncode == 2 and says in r.stderr, r.stderr
        assert r.stderr.startswith("tokenmill prepare: error: ") and r.stderr.count("\n") == 1


def nested():
    def inner(record):
        return record["q"]
    return inner


def test_a_txt_document_a_transform_drops_is_named_by_its_line_whatever_the_unit_size(site):
    # found by the prepare fuzzer (seed 85): a dropped .txt paragraph was named "document 3 of
    # bytes 1000…2000", so two unit sizes (or a finished store met with another) gave two
    # manifests of one corpus
    paragraphs = [f"paragraph {i}: " + ("a long one, kept by the transform " * (i % 3))
                  for i in range(80)]
    (site / "x.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    manifests = []
    for k, (unit_bytes, workers) in enumerate([(1 << 20, 1), (2000, 2), (700, 3)]):
        r = script(site, f"s{k}", inputs="x.txt", transform="fmt:short_dropped",
                   txt_mode="paragraphs", unit_bytes=unit_bytes, workers=workers)
        assert r.returncode == 0, r.stderr
        manifests.append((site / f"s{k}" / "manifest.json").read_bytes())
    assert manifests[1] == manifests[0] and manifests[2] == manifests[0]
    examples = json.loads(manifests[0])["skipped"]["examples"]
    dropped = [i for i, p in enumerate(paragraphs) if len(p) < 40]
    assert [e["where"] for e in examples] == [f"line {2 * i + 1}" for i in dropped[:20]]
    assert {e["reason"] for e in examples} == {"dropped_by_transform"}
    assert byte_texts(site / "s2") == [p for p in paragraphs if len(p) >= 40]


def test_a_failing_transform_names_file_row_and_transform(site):
    rows = records(20)
    write_records(site / "x.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), site / "x.parquet", row_group_size=5)
    r = cli(site, "prepare", "x.jsonl", "--out", "s", "--transform", "fmt:boom")
    assert r.returncode == 2
    assert ("x.jsonl:8: transform fmt:boom raised KeyError: 'no such field'; fix the transform "
            "or pass --on-error skip") in r.stderr, r.stderr
    r = cli(site, "prepare", "x.parquet", "--out", "s", "--transform", "fmt:boom")
    assert r.returncode == 2 and "x.parquet, row 8 (row group 1): transform fmt:boom" in r.stderr
    r = cli(site, "prepare", "x.jsonl", "--out", "s", "--transform", "fmt:boom", "--on-error",
            "skip")
    assert r.returncode == 0 and "transform_error 2" in r.stderr, r.stderr
    assert byte_texts(site / "s") == [x["q"] for x in rows if not x["q"].endswith("7")]


def test_a_resume_with_a_changed_transform_is_refused(site):
    write_records(site / "x.jsonl", records(1000))
    kill_after_first_commit(script(site, "s", transform="fmt:chat", wait=False,
                                   env={"SLOW_TRANSFORM": "1"}), site / "s")
    module = site / "mods" / "fmt.py"
    module.write_text(TRANSFORMS.replace('"<user> "', '"<human> "'))
    r = script(site, "s", transform="fmt:chat")
    assert r.returncode != 0 and "holds an unfinished prepare with other settings" in r.stderr
    assert "(transform: 'fmt:chat (source xxh3 " in r.stderr, r.stderr
    module.write_text(TRANSFORMS)  # the original source: the run resumes and finishes
    r = script(site, "s", transform="fmt:chat")
    assert r.returncode == 0, r.stderr
    assert byte_texts(site / "s") == expected(records(1000))
    r = cli(site, "prepare", "x.jsonl", "--out", "s", "--transform", "fmt:boom",
            "--shard-tokens", 2000)
    assert r.returncode == 2 and "already holds a store prepared with other settings (transform: "\
        "'fmt:chat (source xxh3 " in r.stderr and "→ 'fmt:boom (source xxh3 " in r.stderr


# ---- validation split ------------------------------------------------------------------------

def test_the_split_is_disjoint_complete_and_the_same_for_any_worker_count(site):
    rows = records(400)
    write_records(site / "x.jsonl", rows)
    for workers in (1, 2):
        r = cli(site, "prepare", "x.jsonl", "--out", f"sp{workers}", "--transform", "fmt:chat",
                "--val-fraction", 0.2, "--workers", workers, "--shard-tokens", 3000)
        assert r.returncode == 0, r.stderr
    train, val = site / "sp1" / "train", site / "sp1" / "val"
    assert store_bytes(train) == store_bytes(site / "sp2" / "train")
    assert store_bytes(val) == store_bytes(site / "sp2" / "val")
    want = expected(rows)
    got_train, got_val = byte_texts(train), byte_texts(val)
    assert not digests(train) & digests(val)
    assert sorted(got_train + got_val) == sorted(want) and len(got_train) + len(got_val) == 320
    assert 0.1 < len(got_val) / len(want) < 0.3
    assert got_train == [t for t in want if t in set(got_train)]  # corpus order kept on each side
    m = json.loads((val / "manifest.json").read_text())
    assert m["settings"]["holdout"] == ["val", 0.2]
    assert m["skipped"]["by_reason"] == {"dropped_by_transform": 80, "held_out": len(got_train)}
    assert all(e["reason"] != "held_out" for e in m["skipped"]["examples"])
    shown = cli(site, "inspect", "sp1")
    assert shown.returncode == 0, shown.stderr
    assert (f"split        train side (fraction 0.2): {len(got_train)} of 320 documents "
            f"({len(got_val)} on the val side)") in shown.stdout
    assert (f"split        val side (fraction 0.2): {len(got_val)} of 320 documents "
            f"({len(got_train)} on the train side)") in shown.stdout
    info = json.loads(cli(site, "inspect", "sp1/val", "--json").stdout)
    assert info["split"] == {"side": "val", "fraction": 0.2, "held_out": len(got_train)}


def test_an_interrupted_split_resumes_to_the_same_stores(site):
    write_records(site / "x.jsonl", records(1000))
    opts = dict(transform="fmt:chat", val_fraction=0.1)
    kill_after_first_commit(script(site, "sp", wait=False, env={"SLOW_TRANSFORM": "1"}, **opts),
                            site / "sp" / "train")
    assert script(site, "sp", **opts).returncode == 0
    ref = cli(site, "prepare", "x.jsonl", "--out", "ref", "--transform", "fmt:chat",
              "--val-fraction", 0.1, "--shard-tokens", 2000, "--workers", 1)
    assert ref.returncode == 0, ref.stderr
    for side in ("train", "val"):  # the CLI's other unit size and worker count: the same bytes
        assert store_bytes(site / "sp" / side) == store_bytes(site / "ref" / side)


def test_documents_keep_their_side_when_the_corpus_grows(site):
    (site / "v1").mkdir()
    write_jsonl(site / "v1" / "a.jsonl", [f"old document {i}" for i in range(300)])
    assert cli(site, "prepare", "v1", "--out", "old", "--val-fraction", 0.1).returncode == 0
    (site / "v2").mkdir()
    write_jsonl(site / "v2" / "a.jsonl", [f"old document {i}" for i in range(300)])
    write_jsonl(site / "v2" / "0-new.jsonl", [f"new document {i}" for i in range(300)])
    assert cli(site, "prepare", "v2", "--out", "new", "--val-fraction", 0.1).returncode == 0
    old_val, new_val = set(byte_texts(site / "old" / "val")), set(byte_texts(site / "new" / "val"))
    old_train, new_train = set(byte_texts(site / "old" / "train")), set(byte_texts(site / "new" /
                                                                                 "train"))
    assert old_val and old_val <= new_val and old_train <= new_train
    assert len(new_val - old_val) > 0 and not new_val & new_train


def test_a_split_is_refused_over_a_plain_store_and_when_the_val_side_is_empty(site):
    write_jsonl(site / "x.jsonl", [f"doc {i}" for i in range(20)])
    assert cli(site, "prepare", "x.jsonl", "--out", "plain").returncode == 0
    r = cli(site, "prepare", "x.jsonl", "--out", "plain", "--val-fraction", 0.1)
    assert r.returncode == 2
    assert "plain: holds a store (or an unfinished prepare) made without --val-fraction" in r.stderr
    r = cli(site, "prepare", "x.jsonl", "--out", "tiny", "--val-fraction", 1e-9)
    assert r.returncode == 2 and "no document of the 20 falls on the val side" in r.stderr
    r = cli(site, "prepare", "x.jsonl", "--out", "bad", "--val-fraction", 1)
    assert r.returncode == 2 and "val_fraction must be a number between 0 and 1" in r.stderr
    assert cli(site, "prepare", "x.jsonl", "--out", "sp", "--val-fraction", 0.5).returncode == 0
    r = cli(site, "prepare", "x.jsonl", "--out", "sp")
    assert r.returncode == 2 and "sp: holds the train/ and val/ stores of a split" in r.stderr


def test_keep_side_partitions_texts_and_keeps_skips_in_place():
    texts = [f"t{i}" for i in range(12)]
    val, train = kept_indices(texts, ("val", 0.3)), kept_indices(texts, ("train", 0.3))
    assert sorted(val + train) == list(range(12)) and val and train
    bad = Skip("f", "line 3", "malformed_json", "x")
    kept, skips = keep_side(texts, [(0, bad), (5, bad), (12, bad)], ("val", 0.3), "f")
    assert kept == val
    kept = [texts[i] for i in kept]
    order = []  # replay: skips at their ordinals among the kept texts
    for k in range(len(kept) + 1):
        order += [s.reason if s.reason != "held_out" else "h" for o, s in skips if o == k]
        order += [kept[k]] if k < len(kept) else []
    want = []
    for i, t in enumerate(texts + [None]):
        want += ["malformed_json"] if i in (0, 5, 12) else []
        want += ([t] if i in val else ["h"]) if t is not None else []
    assert order == want


def test_csv_rows_and_json_array_elements_reach_the_transform_whole(site):
    rows = records(30)
    (site / "t").mkdir()
    with open(site / "t" / "a.csv", "w", newline="") as f:  # every column, as strings
        w = csv.writer(f)
        w.writerow(["q", "a"])
        w.writerows((r["q"], r["a"]) for r in rows[:12])
    (site / "t" / "b.json").write_text(json.dumps(rows[12:]))  # a top-level array
    r = cli(site, "prepare", "t", "--out", "s", "--transform", "fmt:chat", "--workers", 2)
    assert r.returncode == 0, r.stderr
    csv_docs = ["<user> " + x["q"] + " <bot> " + x["a"] for x in rows[:12]]
    assert byte_texts(site / "s") == csv_docs + expected(rows[12:])


# ---- a transform is known by what it does (issue 22.1) -------------------------------------

HELPED = '''
import os
import sys
import time

from helpers import render

PREFIX = "<user> "


def chat(record):
    if os.environ.get("SLOW_TRANSFORM"):
        time.sleep(0.002)
    return render(PREFIX, record)


def leave(record):
    if record["q"] == "question 50":
        sys.exit(0)
    return record["q"]
'''
HELPERS = '''
SEPARATOR = " <bot> "


def render(prefix, record):
    return prefix + record["q"] + SEPARATOR + record["a"]
'''
CHAOS = '''
import random

TEMPLATES = ["<user> {q} <bot> {a}", "User: {q}\\nAssistant: {a}", "Q: {q} A: {a}"]


def template(record):
    """A random chat template: another text for the same record at each call."""
    return random.choice(TEMPLATES).format(**record)


def bag(record):
    """The same text within a process, another in the next: a set's order follows hash(str)."""
    return " ".join({*record["q"].split(), *record["a"].split(), "a", "b", "c", "d"})
'''


def helped(site: Path) -> list[str]:
    """Write the transform modules beside the corpus; what chat makes of records(1000)."""
    (site / "mods" / "fmtc.py").write_text(HELPED)
    (site / "mods" / "helpers.py").write_text(HELPERS)
    (site / "mods" / "chaos.py").write_text(CHAOS)
    rows = records(1000)
    write_records(site / "x.jsonl", rows)
    return ["<user> " + x["q"] + " <bot> " + x["a"] for x in rows]


@pytest.mark.parametrize("module,old,new", [
    ("fmtc.py", 'PREFIX = "<user> "', 'PREFIX = "<human> "'),  # a constant beside the function
    ("helpers.py", 'SEPARATOR = " <bot> "', 'SEPARATOR = " <assistant> "')])  # another module
def test_a_resume_after_the_transform_behaves_otherwise_is_refused(site, module, old, new):
    want = helped(site)
    kill_after_first_commit(script(site, "s", transform="fmtc:chat", wait=False,
                                   env={"SLOW_TRANSFORM": "1"}), site / "s")
    path = site / "mods" / module
    path.write_text(path.read_text().replace(old, new))  # chat's own source is unchanged
    r = script(site, "s", transform="fmtc:chat")
    assert r.returncode != 0 and "holds an unfinished prepare with other settings" in r.stderr, \
        r.stderr
    assert "(transform: 'fmtc:chat (source xxh3 " in r.stderr and " sample records xxh3 " in r.stderr
    path.write_text(path.read_text().replace(new, old))  # as it was: the run resumes, one version
    r = script(site, "s", transform="fmtc:chat")
    assert r.returncode == 0, r.stderr
    assert byte_texts(site / "s") == want


def test_a_transform_that_is_not_deterministic_is_refused_and_a_split_accounts_for_every_document(site):
    helped(site)
    for args in (("--val-fraction", 0.2), ()):  # a random template: refused before anything is written
        r = cli(site, "prepare", "x.jsonl", "--out", "sp", "--transform", "chaos:template", *args)
        assert r.returncode == 2 and re.search(
            r"error: transform chaos:template is not deterministic: given the same record 3 "
            r"times \(x\.jsonl:\d+\) it returned '.*', then '.*'; ", r.stderr), r.stderr
        assert "draw any randomness from the record itself" in r.stderr
        assert not list(site.glob("sp/**/manifest.json"))
    # the same text within a process, another in each worker process: caught by the accounts
    env = {"PYTHONHASHSEED": None}  # unset: each process draws its own
    r = cli(site, "prepare", "x.jsonl", "--out", "bag", "--transform", "chaos:bag",
            "--val-fraction", 0.2, "--workers", 2, env=env)
    assert r.returncode == 2, r.stderr
    assert "the split does not account for every document: the train store holds " in r.stderr
    assert (f"the transform chaos:bag gave the records of {site / 'x.jsonl'} other texts in the "
            "two passes: it is not deterministic") in r.stderr, r.stderr
    r = cli(site, "prepare", "x.jsonl", "--out", "bag", "--transform", "chaos:bag",
            "--val-fraction", 0.2, "--workers", 2, env=env)  # a new process: other sample texts
    assert r.returncode == 2 and "bag/train: already holds a store prepared with other settings " \
        "(transform: 'chaos:bag (source xxh3 " in r.stderr, r.stderr


TABLED = """
import os
import time

from table import TABLE


def to_text(record):
    if os.environ.get("SLOW_TRANSFORM"):
        time.sleep(0.002)
    return TABLE.get(record["id"], "") + record["text"]
"""


def test_a_resume_after_a_helper_module_changed_only_records_past_the_samples_is_refused(site):
    # the transform's own module unchanged; a table it imports edited for one record outside the
    # sampled ones (the first 32 records of the first 4 files), between a kill -9 and the rerun
    (site / "mods" / "tabled.py").write_text(TABLED)
    table = site / "mods" / "table.py"
    table.write_text("TABLE = {}\n")
    (site / "in").mkdir()
    for k in range(6):
        write_records(site / "in" / f"x{k}.jsonl",
                      [{"id": i, "text": f"document {i}"} for i in range(200 * k, 200 * k + 200)])
    args = ("prepare", "in", "--out", "s", "--transform", "tabled:to_text", "--shard-tokens",
            2000, "--workers", 2)
    kill_after_first_commit(cli(site, *args, env={"SLOW_TRANSFORM": "1"}, wait=False), site / "s")
    table.write_text('TABLE = {1100: "NEW "}\n')  # record 1100: x5.jsonl, never sampled
    r = cli(site, *args)
    assert r.returncode == 2, r.stderr  # before: exit 0, a store of both versions
    assert "s: holds an unfinished prepare with other settings (transform: 'tabled:to_text " \
        "(source xxh3 " in r.stderr and " of table + tabled, 128 sample records" in r.stderr
    assert not (site / "s" / "manifest.json").exists()
    table.write_text("TABLE = {}\n")  # as it was: the run resumes, one version of everything
    r = cli(site, *args)
    assert r.returncode == 0, r.stderr
    assert byte_texts(site / "s") == [f"document {i}" for i in range(1200)]


STOPPED = """
import os
import time
from pathlib import Path

STOPWORDS = set((Path(__file__).parent / "stopwords.txt").read_text().split())  # a data file


def to_text(record):
    if os.environ.get("SLOW_TRANSFORM"):
        time.sleep(0.002)
    return " ".join(w for w in record["text"].split() if w not in STOPWORDS)
"""
RULED = """
import importlib
import os
import time

rules = importlib.import_module("zoo_rules")  # by name: no import statement names it


def to_text(record):
    if os.environ.get("SLOW_TRANSFORM"):
        time.sleep(0.002)
    return rules.apply(record["text"])
"""


def zoo(site: Path) -> list[str]:
    """x.jsonl: 1,000 records; the first 40 (the sampled 32 among them) hold none of the words
    the transforms' data below change, the others do. The records' texts."""
    texts = [f"r{i} " + ("plain words" if i < 40 else "zebra and the lion") for i in range(1000)]
    write_records(site / "x.jsonl", [{"text": t} for t in texts])
    return texts


def test_a_resume_after_a_data_file_the_transform_reads_changed_is_refused(site):
    # the transform's module and its output on the sampled records unchanged; its stopword list
    # (read at import) edited between a kill -9 and the rerun: before, exit 0 and a store whose
    # committed documents lack "the" and the rest also "and"
    texts = zoo(site)
    (site / "mods" / "stopped.py").write_text(STOPPED)
    words = site / "mods" / "stopwords.txt"
    words.write_text("the\n")
    args = ("prepare", "x.jsonl", "--out", "s", "--transform", "stopped:to_text",
            "--shard-tokens", 2000, "--workers", 2)
    kill_after_first_commit(cli(site, *args, env={"SLOW_TRANSFORM": "1"}, wait=False), site / "s")
    words.write_text("the\nand\n")
    r = cli(site, *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        "tokenmill prepare: error: s: holds an unfinished prepare whose transform stopped:to_text "
        "made other texts of x.jsonl (work unit 0, committed) than it makes now: the "
        "transform, or something it loads (a module, a data file), changed since the run was "
        "interrupted; restore it as it was to finish the run, or pass --overwrite to start over "
        "with the transform as it is now"]
    assert not (site / "s" / "manifest.json").exists()
    r = cli(site, *args, "--overwrite")  # the transform as it is now, everywhere
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[0] == (
        "note: s: the interrupted run's transform stopped:to_text made other texts of x.jsonl "
        "(work unit 0, committed) than it makes now; starting over (--overwrite)")
    assert byte_texts(site / "s") == [" ".join(w for w in t.split() if w not in ("the", "and"))
                                      for t in texts]


def test_a_resume_after_a_helper_loaded_by_importlib_changed_is_refused(site):
    # a helper module loaded by importlib.import_module (no import statement names it, so the
    # transform's source xxh3 does not cover it), edited for words past the sampled records
    # between a kill -9 and the rerun: before, exit 0 and a store of both versions
    texts = zoo(site)
    (site / "mods" / "ruled.py").write_text(RULED)
    rules = site / "mods" / "zoo_rules.py"
    rules.write_text('def apply(text):\n    return text.replace("zebra", "ZEBRA")\n')
    kill_after_first_commit(script(site, "s", transform="ruled:to_text", wait=False,
                                   env={"SLOW_TRANSFORM": "1"}), site / "s")
    rules.write_text('def apply(text):\n    return text.replace("zebra", "Zebra")\n')
    r = script(site, "s", transform="ruled:to_text")
    assert r.returncode == 1, r.stderr
    assert re.search(r"ConfigError: s: holds an unfinished prepare whose transform ruled:to_text "
                     r"made other texts of .*x\.jsonl \(work unit \d+, committed\) than it makes "
                     r"now: .*; restore it as it was to finish the run, or pass --overwrite",
                     r.stderr.strip().splitlines()[-1]), r.stderr
    assert not (site / "s" / "manifest.json").exists()
    rules.write_text('def apply(text):\n    return text.replace("zebra", "ZEBRA")\n')
    r = script(site, "s", transform="ruled:to_text")  # restored: it resumes, one version
    assert r.returncode == 0, r.stderr
    assert byte_texts(site / "s") == [t.replace("zebra", "ZEBRA") for t in texts]


SECOND_THOUGHTS = """
from collections import Counter

SEEN = Counter()
TEXTS = {TEXTS!r}


def to_text(record):
    \"\"\"Another text the second time it meets a record, for two records past the samples.\"\"\"
    if record["id"] not in TEXTS:
        return record["text"]
    SEEN[record["id"]] += 1
    return TEXTS[record["id"]][SEEN[record["id"]] > 1]
"""


def test_a_split_whose_passes_gave_a_record_two_texts_is_refused_even_when_counts_agree(site):
    # in one process (--workers 1) the transform sees each record once per pass: record 700
    # is on the val side in the train pass and on the train side in the val pass (in neither
    # store), record 1000 the other way round (in both): the counts agree
    def text(record_id: int, val: bool) -> str:
        return next(t for n in range(1000) if is_val(t := f"document {record_id} v{n}", 0.3) == val)
    texts = {700: (text(700, True), text(700, False)), 1000: (text(1000, False), text(1000, True))}
    (site / "mods" / "second.py").write_text(SECOND_THOUGHTS.replace("{TEXTS!r}", repr(texts)))
    (site / "in").mkdir()
    for k in range(6):
        write_records(site / "in" / f"x{k}.jsonl",
                      [{"id": i, "text": f"document {i}"} for i in range(200 * k, 200 * k + 200)])
    r = cli(site, "prepare", "in", "--out", "sp", "--transform", "second:to_text",
            "--val-fraction", 0.3, "--workers", 1)
    assert r.returncode == 2, r.stderr  # before: exit 0, document 1000 on both sides, 700 on none
    assert r.stderr.endswith(
        "the split does not account for every document: the train store holds 839 and held out "
        "361, the val store holds 361 and held out 839 (each side must hold what the other held "
        "out, document by document); the transform second:to_text gave the records of "
        f"{site / 'in' / 'x3.jsonl'} other texts in the two passes: it is not deterministic (in "
        "every process and at every call? e.g. no set order or hash() of str, no time, no "
        "unseeded random, no state kept between calls): fix that and run again with "
        "--overwrite\n"), r.stderr

STREAM = """
import sys
from tokenmill import Loader

loader = Loader.from_text(["x.jsonl"], transform="fmtc:chat", cache_dir="cache", seq_len=64,
                          batch_size=4, num_workers=1, shuffle_buffer=16)
seen = bytearray()
for step, batch in zip(range(int(sys.argv[1])), loader):
    seen += bytes(t for t in batch["inputs"].ravel().tolist() if t < 256)
loader.close()
print(seen.count(b"<bot>"), seen.count(b"<assistant>"))
"""


def test_a_streaming_cache_made_by_a_transform_that_behaves_otherwise_is_not_reused(site):
    helped(site)
    (site / "stream.py").write_text(STREAM)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site / "mods"),
                                                         os.environ.get("PYTHONPATH", "")])}

    def stream(steps: int) -> list[int]:
        r = subprocess.run([sys.executable, "stream.py", str(steps)], cwd=site, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return [int(x) for x in r.stdout.split()]

    bot, assistant = stream(600)  # more than one pass: the cache is complete
    assert bot > 0 and assistant == 0 and len(list((site / "cache").glob("*/manifest.json"))) == 1
    helpers = site / "mods" / "helpers.py"
    helpers.write_text(HELPERS.replace('" <bot> "', '" <assistant> "'))
    bot, assistant = stream(20)
    assert bot == 0 and assistant > 0  # tokenized anew, never the stale cache
    assert len([p for p in (site / "cache").glob("stream-*") if p.is_dir()]) == 2


def test_a_transform_calling_sys_exit_fails_naming_it_and_the_record(site):
    helped(site)
    for workers in (1, 2):
        r = cli(site, "prepare", "x.jsonl", "--out", f"s{workers}", "--transform", "fmtc:leave",
                "--workers", workers, "--on-error", "skip")
        assert r.returncode == 2, r.stderr
        assert r.stderr.endswith("tokenmill prepare: error: x.jsonl:51: transform fmtc:leave "
                                 "called sys.exit(0); a transform returns the text, or None to "
                                 "drop the record, or raises an exception: fix the transform\n"), \
            r.stderr
        assert not (site / f"s{workers}" / "manifest.json").exists()


# ---- the same checks with a transform as without (issue 22.4) ------------------------------

def test_records_given_to_a_transform_are_checked_as_documents_are(site):
    (site / "bad.csv").write_bytes(b"q,a\nquestion 0,answer 0\nquestion 1,bad \xff byte\n"
                                   b"question 2,answer 2\n")
    (site / "dup.csv").write_text("q,a,a\nquestion 0,first,second\n")
    pq.write_table(pa.table([pa.array(["question 0"]), pa.array(["first"]), pa.array(["second"])],
                            names=["q", "a", "a"]), site / "dup.parquet")
    (site / "bad.json").write_bytes(b'[{"q": "question 0", "a": "answer 0"}, '
                                    b'{"q": "question 1", "a": "bad \xff byte"}]')
    for name, says in [("bad.csv", "bad.csv, row 2 (line 3): invalid UTF-8 (byte 0xff at "
                                   "character 5 of 'a')"),
                       ("dup.csv", "dup.csv: malformed row (the header names column 'a' 2 "
                                   "times; rename all but one)"),
                       ("bad.json", "bad.json, element 2: invalid UTF-8 (byte 0xff at "
                                    "character 5 of 'a')"),
                       ("dup.parquet", "dup.parquet: malformed row (the schema names column 'a' "
                                       "2 times; rename all but one)")]:
        for args in (("--text-key", "a"), ("--transform", "fmt:chat")):
            r = cli(site, "prepare", name, "--out", "s", *args)
            assert r.returncode == 2 and says in r.stderr, (args, r.stderr)
    for args in (("--text-key", "a"), ("--transform", "fmt:chat")):
        r = cli(site, "prepare", "bad.csv", "--out", "s", "--on-error", "skip", "--overwrite", *args)
        assert r.returncode == 0 and "skipped 1 (invalid_utf8 1)" in r.stderr, r.stderr
        assert len(byte_texts(site / "s")) == 2 and not any("\ufffd" in t for t in byte_texts(site / "s"))

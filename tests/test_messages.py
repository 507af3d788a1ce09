"""Messages as users meet them (issue 22, "bad errors"): each ordinary mistake is one line that
says what happened, to which file, and what to do — through the command line (real processes)
or the API call that meets it — never a traceback, and never a false refusal."""

import copy
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from conftest import write_jsonl
from tokenmill import Loader, prepare
from tokenmill.base.errors import ConfigError, StoreError


def tm(*args, cwd=None):
    """``tokenmill ARGS`` in a fresh process: (exit code, stdout, stderr)."""
    done = subprocess.run([sys.executable, "-m", "tokenmill", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


def one_error_line(stderr: str, command: str) -> str:
    """The single line an ordinary failure prints (no traceback), without its prefix."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    prefix = f"tokenmill {command}: error: "
    assert lines[0].startswith(prefix), lines[0]
    return lines[0][len(prefix):]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_jsonl(root / "a.jsonl", [f"document {i}: " + "some words " * (i % 9 + 3)
                                   for i in range(200)])
    return root / "a.jsonl"


@pytest.fixture(scope="module")
def store(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("store") / "store"
    prepare([str(data)], out=out, workers=1, progress=False)
    return out


@pytest.fixture(scope="module")
def seed3_state(store, tmp_path_factory):
    """A seed-3 run's state after two steps, saved as JSON, and as torch.save would (a zip)."""
    root = tmp_path_factory.mktemp("state")
    with Loader(store, seq_len=32, batch_size=4, seed=3, num_workers=0) as ld:
        it = iter(ld)
        next(it), next(it)
        state = ld.state_dict()
    (root / "state.json").write_text(json.dumps(state))
    (root / "state.pt").write_bytes(b"PK\x03\x04" + pickle.dumps(state))  # torch.save: a zip
    return root


# ---- resume-check and explain --------------------------------------------------------------

def test_resume_check_reads_the_runs_settings_from_the_state(store, seed3_state):
    # was "NOT SAFE  seed 3 → 0" (exit 1) until --seed 3 was given; --seq-len and
    # --batch-size were required although the state records them
    code, out, err = tm("resume-check", seed3_state / "state.json", store)
    assert code == 0 and out.splitlines() == ["resumes exactly at consumed_samples=8"], out + err
    code, out, _ = tm("resume-check", seed3_state / "state.json", store, "--seed", "4",
                      "--batch-size", "2")  # a flag given is the new run's: checked against it
    assert code == 1 and "NOT SAFE  seed 3 → 4" in out and "safe      batch_size 4 → 2" in out
    old = seed3_state / "old.json"  # a three-key state records no settings: say which to pass
    old.write_text(json.dumps({k: json.loads((seed3_state / "state.json").read_text())[k]
                               for k in ("version", "consumed_samples", "fingerprint")}))
    code, _, err = tm("resume-check", old, store)
    assert code == 2 and "pass --seq-len and --batch-size as the run had them" in \
        one_error_line(err, "resume-check")
    code, out, _ = tm("resume-check", old, store, "--seq-len", 32, "--batch-size", 4, "--seed", 3)
    assert code == 0 and "resumes exactly" in out


def test_resume_check_on_a_file_that_is_not_a_json_state_is_one_line(store, seed3_state):
    # was a UnicodeDecodeError / JSONDecodeError traceback
    code, _, err = tm("resume-check", seed3_state / "state.pt", store)
    line = one_error_line(err, "resume-check")
    assert code == 2 and line.startswith(f"{seed3_state / 'state.pt'}: not a JSON loader state "
                                         "(a torch.save or pickle file?)")
    assert "json.dump(loader.state_dict()" in line
    (seed3_state / "list.json").write_text("[1, 2]")
    code, _, err = tm("resume-check", seed3_state / "list.json", store)
    assert code == 2 and "holds a JSON list, not a loader state" in one_error_line(err, "resume-check")


def test_mixture_in_python_syntax_is_read_and_nonsense_is_one_line(store, tmp_path):
    with Loader({"web": store, "code": store}, seq_len=32, batch_size=2, num_workers=0,
                mixture=[(0, {"web": 0.5, "code": 0.5})]) as ld:
        want = [(o.row, o.store, o.draw) for o in ld.explain(1)]
    common = ["web=" + str(store), "code=" + str(store), "--seq-len", 32, "--batch-size", 2,
              "--step", 1, "--seed", 0, "--layout", "concat", "--world-size", 1]
    # was a JSONDecodeError traceback: single quotes and tuples are a Python literal, read as one
    code, out, err = tm("explain", *common, "--mixture", "[(0, {'web': 0.5, 'code': 0.5})]")
    assert code == 0, err
    got = [(int(line.split()[1]), line.split()[5], int(line.split()[7].replace(",", "")))
           for line in out.splitlines()]
    assert sorted(set(got)) == sorted(want)
    code, _, err = tm("explain", *common, "--mixture", "[(0, {'web': 0.5,")
    line = one_error_line(err, "explain")
    assert code == 2 and line.startswith("--mixture \"[(0, {'web': 0.5,\" is neither JSON nor")


def test_explain_refuses_a_negative_step(store):
    # was "step and start must be >= 0 (got step=0, start=-4)": another number than the one given
    code, _, err = tm("explain", store, "--seq-len", 32, "--batch-size", 4, "--step", -1,
                      "--seed", 0, "--layout", "concat", "--world-size", 1)
    assert code == 2 and one_error_line(err, "explain") == "step must be an int >= 0 (got step=-1)"
    with Loader(store, seq_len=32, batch_size=4) as ld, pytest.raises(ConfigError, match="step=-1"):
        ld.explain(-1)


def test_a_store_path_holding_an_equals_sign_is_a_store_not_a_name(store, seed3_state, tmp_path):
    # was "named stores need the mixture phases" for runs/lr=3e-4/store
    moved = tmp_path / "runs" / "lr=3e-4" / "store"
    moved.parent.mkdir(parents=True)
    os.rename(store, moved)
    try:
        code, out, err = tm("explain", moved, "--seq-len", 32, "--batch-size", 2, "--step", 0,
                            "--seed", 0, "--layout", "concat", "--world-size", 1)
        assert code == 0 and out.startswith("row 0  sample 0  store " + str(moved)), err
        # and a moved store resumes: its path changed, not its content
        code, out, err = tm("resume-check", seed3_state / "state.json", moved)
        assert code == 0, out + err
        assert out.splitlines() == [
            f"safe      store paths ['{store}'] → ['{moved}'] (the same stores, moved)",
            "resumes exactly at consumed_samples=8"]
    finally:
        os.rename(moved, store)


# ---- a --val-fraction folder given where a store is expected ---------------------------------

def test_every_command_pointed_at_a_split_folder_names_its_two_stores(data, tmp_path):
    out = tmp_path / "split"
    prepare([str(data)], out=out, workers=1, progress=False, val_fraction=0.2)
    # was "split/manifest.json: missing — is this a tokenmill store? Create one with 'tokenmill
    # prepare'" from each of these
    want = (f"{out}: holds the two stores of a --val-fraction split, not one store; use "
            f"{out / 'train'} or {out / 'val'}")
    for args in (["explain", out, "--seq-len", 32, "--batch-size", 2, "--step", 0, "--seed", 0,
                  "--layout", "concat", "--world-size", 1],
                 ["plan", "--seq-len", 32, "--batch-size", 2, "--layout", "packed", "--store", out],
                 ["export", out, "--format", "jsonl", "--out", tmp_path / "x.jsonl"],
                 ["inspect", out, "--seq-len", 32]):
        code, _, err = tm(*args)
        assert code == 2 and one_error_line(err, args[0]) == want, args
    code, stdout, _ = tm("verify", out)
    assert code == 1 and stdout.splitlines()[0] == f"BAD  {want}"
    with pytest.raises(StoreError) as e:
        Loader(out, seq_len=32, batch_size=2)
    assert str(e.value) == want


# ---- streaming ---------------------------------------------------------------------------------

FULL_DISK = textwrap.dedent("""
    import resource, signal, sys
    from tokenmill import Loader
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    loader = Loader.from_text([sys.argv[1]], seq_len=32, batch_size=2, cache_dir=sys.argv[2],
                              num_workers=0, shard_tokens=3000)
    for batch in loader:
        pass
""")


def test_a_full_cache_dir_says_so_of_cache_dir_not_prepare(data, tmp_path):
    (tmp_path / "train.py").write_text(FULL_DISK)
    done = subprocess.run([sys.executable, "train.py", str(data), str(tmp_path / "cache")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    # was "…: the disk is full; free some space and run the same command again ('tokenmill
    # prepare' resumes where it stopped)"
    assert done.returncode != 0 and last.startswith("tokenmill.base.errors.DiskFullError: "), done.stderr
    assert f"cannot write (File too large): the disk holding cache_dir {tmp_path / 'cache'} is " \
           "full; free some space or pass a cache_dir on a disk with room" in last
    assert "prepare" not in last


@pytest.mark.parametrize("change,named", [
    (dict(pack_window=16), "pack_window 8 → 16"),
    (dict(max_segments=5), "max_segments 4 → 5"),
    (dict(max_segments=None), "max_segments 4 → None"),
    (dict(shuffle_buffer=9, seed=1), "seed 0 → 1, shuffle_buffer 16 → 9"),
])
def test_a_stream_resumed_with_other_settings_names_them(data, tmp_path, change, named):
    settings = dict(seq_len=32, batch_size=2, cache_dir=tmp_path / "cache", num_workers=0,
                    layout="packed", pack_window=8, max_segments=4, shuffle_buffer=16)
    with Loader.from_text([str(data)], **settings) as a:
        next(iter(a))
        state = json.loads(json.dumps(a.state_dict()))
    # was "…: the inputs (or their sizes/times), tokenizer, options, seq_len, seed or
    # shuffle_buffer differ": neither pack_window nor max_segments named
    with Loader.from_text([str(data)], **{**settings, **change}) as b:
        with pytest.raises(ConfigError) as e:
            b.load_state_dict(state)
    assert f": {named} (the saved run's → this loader's); make the loader with the saved " \
           "run's settings to resume it" in str(e.value)
    with Loader.from_text([str(data)], **settings) as a:  # the same settings still resume
        a.load_state_dict(state)


# ---- prepare, plan, pickle --------------------------------------------------------------------

def test_a_store_inside_its_own_input_folder_reruns_as_complete(data, tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(data.read_bytes())
    code, _, err = tm("prepare", folder, "--out", folder / "store", "--quiet")
    assert code == 0, err
    # was "already holds a store prepared with other settings (… num_files: 1 → 2)": the walk
    # read the store's own manifest.json as a .json input
    code, _, err = tm("prepare", folder, "--out", folder / "store")
    assert code == 0 and f"{folder / 'store'}: already complete (200 documents" in err, err


@pytest.mark.parametrize("args,line", [
    (["--seq-len", -5, "--batch-size", 2], "seq_len must be an int >= 1 (got seq_len=-5)"),
    (["--seq-len", 8, "--batch-size", 0], "batch_size must be an int >= 1 (got batch_size=0)"),
    (["--seq-len", 8, "--batch-size", 2, "--prefetch", -1],
     "prefetch must be an int >= 1 (got prefetch=-1)"),
])
def test_plan_refuses_impossible_sizes(args, line):
    # --seq-len -5 printed "batch ring -0.00 MiB" and exited 0
    code, out, err = tm("plan", *args)
    assert code == 2 and out == "" and one_error_line(err, "plan") == line


def test_pickling_or_copying_a_loader_says_to_pickle_its_state(store, tmp_path):
    # was "TypeError: cannot pickle '_thread._local' object"
    with Loader(store, seq_len=32, batch_size=2) as ld:
        for attempt in (pickle.dumps, copy.deepcopy, copy.copy):
            with pytest.raises(TypeError, match=r"^a Loader cannot be pickled or copied .* pickle "
                               r"its state_dict\(\) instead .*TokenDataset\(loader\)$"):
                attempt(ld)
        back = Loader(store, seq_len=32, batch_size=2)  # what the message says to do works
        back.load_state_dict(pickle.loads(pickle.dumps(ld.state_dict())))
        back.close()
    write_jsonl(tmp_path / "t.jsonl", ["a few words of text"] * 9)
    with Loader.from_text([str(tmp_path / "t.jsonl")], seq_len=8, batch_size=2, num_workers=0,
                          cache_dir=tmp_path / "c") as streaming:
        with pytest.raises(TypeError, match=r"^a StreamLoader cannot be pickled or copied"):
            pickle.dumps(streaming)

"""The Ray engine: the same store as the local engine, byte for byte; resumes after SIGKILL;
errors arrive as themselves; nothing left behind in ~ or /tmp/ray. One local Ray instance
(2 CPUs, 127.0.0.1, no dashboard) serves the module; deselect with ``-m "not ray"``."""

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import OnTerminal, held_corpus, store_bytes, write_jsonl
from tokenmill.base.errors import ConfigError, InputError
from tokenmill.prepare.ray import Job, cut, stage_unit
from tokenmill.prepare import PrepareConfig, prepare
from tokenmill.inputs.sources import Unit
from tokenmill.store import ShardWriter

pytestmark = pytest.mark.ray

SMALL = dict(shard_tokens=40_000, unit_bytes=64_000)  # ~10 shards, ~25 units of 1.5 MB
LEFTOVERS = [Path.home() / ".ray", Path("/tmp/ray")]  # Ray's defaults, kept out of by the env below
LEFTOVERS_BEFORE: dict[Path, bool] = {}


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance; its files in a short temp dir (socket paths must stay < 108 chars)."""
    LEFTOVERS_BEFORE.update({p: p.exists() for p in LEFTOVERS})
    env = {"RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # bind 127.0.0.1 (read when ray is imported)
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # token auth on, the token not in ~/.ray
    saved = {k: os.environ.get(k) for k in (*env, "RAY_TMPDIR", "RAY_AUTH_MODE")}
    tmp = tempfile.mkdtemp(prefix="tm-ray-")
    os.environ.update(env, RAY_TMPDIR=tmp)
    import ray
    try:
        ctx = ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp,
                       _node_ip_address="127.0.0.1", configure_logging=False, log_to_driver=False)
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        assert {p: p.exists() for p in LEFTOVERS} == LEFTOVERS_BEFORE, "Ray left files behind"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, real_texts):
    """Two files of real text with bad records (skipped, counted, 3 kinds) among the documents."""
    d = tmp_path_factory.mktemp("corpus")
    write_jsonl(d / "a.jsonl", real_texts[:30])
    lines = (d / "a.jsonl").read_text().splitlines(keepends=True)
    lines[3:3] = ["not json\n", '{"nope": 1}\n', '{"text": ""}\n']
    lines[20:20] = ["{broken\n"]
    (d / "a.jsonl").write_text("".join(lines))
    write_jsonl(d / "b.jsonl", real_texts[30:])
    return d


def test_byte_identical_to_the_local_engine(ray_cluster, tmp_path, corpus, bpe_tokenizer):
    args = dict(tokenizer=bpe_tokenizer, on_error="skip", progress=False, **SMALL)
    want = prepare([str(corpus)], out=tmp_path / "local", workers=2, **args)
    got = prepare([str(corpus)], out=tmp_path / "ray", engine="ray", **args)
    assert got == want
    assert want["skipped"]["by_reason"] == {"empty_document": 1, "malformed_json": 2,
                                            "missing_field": 1}
    assert len(want["shards"]) >= 8
    local = store_bytes(tmp_path / "local")
    assert store_bytes(tmp_path / "ray") == local
    # to a URL: tasks write shards straight to it, staging too
    prepare([str(corpus)], out=f"file://{tmp_path}/url", engine="ray", **args)
    assert store_bytes(tmp_path / "url") == local
    assert not any((tmp_path / d / ".progress").exists() for d in ("ray", "url"))
    # a finished store is a no-op for either engine
    assert prepare([str(corpus)], out=tmp_path / "ray", engine="ray", **args) == want
    assert store_bytes(tmp_path / "ray") == local
    # the command line, starting a private Ray instance (its files under $RAY_TMPDIR, set by
    # the fixture) and with default units: unit size never changes the bytes
    subprocess.run([sys.executable, "-m", "tokenmill", "prepare", str(corpus), "--out",
                    str(tmp_path / "cli"), "--tokenizer", bpe_tokenizer, "--on-error", "skip",
                    "--shard-tokens", str(SMALL["shard_tokens"]), "--engine", "ray",
                    "--workers", "2", "--quiet"], check=True)
    assert store_bytes(tmp_path / "cli") == local


_SCRIPT = """import sys
from tokenmill.prepare import prepare
prepare([sys.argv[1]], out=sys.argv[2], tokenizer=sys.argv[3], engine="ray",
        ray_address=sys.argv[4], shard_tokens=30_000, unit_bytes=100_000, progress=False)
"""


def _start_and_kill(cmd, out: Path, committed: int) -> None:
    """Run ``cmd`` and SIGKILL it once ``committed`` shards are committed."""
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 60
    while len(list((out / ".progress").glob("shard-*.json"))) < committed:
        assert proc.poll() is None, "prepare finished before it could be interrupted"
        assert time.monotonic() < deadline, f"not {committed} shards committed within 60 s"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()


def test_resume_after_sigkill_is_byte_identical(ray_cluster, tmp_path, real_texts, bpe_tokenizer):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", real_texts * 3)
    ref = tmp_path / "ref"  # the local engine, default units: unit size never changes the bytes
    prepare([str(corpus)], out=ref, tokenizer=bpe_tokenizer, workers=2, shard_tokens=30_000,
            progress=False)
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", _SCRIPT, str(corpus), str(out), bpe_tokenizer, ray_cluster]
    _start_and_kill(cmd, out, committed=3)
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-0000[012].*")}
    assert len(kept) == 9  # .bin, .idx, .src each
    _start_and_kill(cmd, out, committed=8)  # the Ray engine resumes the Ray engine …
    assert {n: (out / n).stat().st_mtime_ns for n in kept} == kept  # committed: kept as they were
    subprocess.run(cmd, check=True)
    assert store_bytes(out) == store_bytes(ref)
    assert not (out / ".progress").exists()


def test_either_engine_finishes_the_others_run(ray_cluster, tmp_path, real_texts, bpe_tokenizer):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", real_texts * 2)
    args = dict(tokenizer=bpe_tokenizer, shard_tokens=30_000, unit_bytes=100_000, progress=False)
    ref, out = tmp_path / "ref", tmp_path / "out"
    prepare([str(corpus)], out=ref, workers=1, **args)
    _start_and_kill([sys.executable, "-c", _SCRIPT, str(corpus), str(out), bpe_tokenizer,
                     ray_cluster], out, committed=4)
    prepare([str(corpus)], out=out, workers=1, **args)  # Ray's progress records, finished locally
    assert store_bytes(out) == store_bytes(ref)


def test_input_errors_arrive_as_themselves(ray_cluster, tmp_path):
    write_jsonl(tmp_path / "c.jsonl", ["fine"] * 5)
    with open(tmp_path / "c.jsonl", "a") as f:
        f.write("not json\n")
    with pytest.raises(InputError) as local:
        prepare([str(tmp_path / "c.jsonl")], out=tmp_path / "l", workers=1, progress=False)
    with pytest.raises(InputError) as remote:
        prepare([str(tmp_path / "c.jsonl")], out=tmp_path / "r", engine="ray", progress=False)
    assert str(remote.value) == str(local.value)
    assert (remote.value.where, remote.value.reason) == ("line 6", "malformed_json")


def test_staged_units_are_reused_not_tokenized_again(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "abc"}\n{"text": ""}\n{"text": "de"}\n')
    unit = Unit(str(tmp_path / "c.jsonl"), 0, -1)
    job = Job(config=PrepareConfig(), out=str(tmp_path), staging=str(tmp_path), dtype="uint16",
              key="k", cwd="/")
    st = stage_unit(job, 0, unit)
    assert (st.index, st.lengths.tolist(), st.num_tokens) == (0, [4, 3], 7)
    assert [(o, s.reason) for o, s in st.skips] == [(1, "empty_document")]
    assert st.digest is not None  # the input's bytes, recorded for a resume to check
    # same key: read back without loading the tokenizer (this spec would not load)
    bogus = Job(**{**job.__dict__, "config": PrepareConfig(tokenizer="/nonexistent.json")})
    again = stage_unit(bogus, 0, unit)
    assert again.index == 0 and again.lengths.tolist() == [4, 3] and again.skips == st.skips
    assert again.digest == st.digest
    # another key: the staged unit is not trusted
    with pytest.raises(Exception, match="nonexistent"):
        stage_unit(Job(**{**bogus.__dict__, "key": "other"}), 0, unit)


@pytest.mark.parametrize("seed", range(20))
def test_cut_follows_the_shard_writer(tmp_path, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 9, size=rng.integers(0, 60))  # zero-token documents too
    shard_tokens = int(rng.integers(1, 30))
    w = ShardWriter(tmp_path, dtype=np.uint16, shard_tokens=shard_tokens)
    want = [n for _, n in w.add(np.zeros(int(lengths.sum()), np.uint16), lengths)]
    w.abort()
    cuts = sorted(rng.choice(len(lengths) + 1, size=min(4, len(lengths) + 1), replace=False))
    got, fill, start = [], 0, 0
    for stop in [*cuts, len(lengths)]:  # the same documents arriving in units of any size
        closes, fill = cut(lengths[start:stop], fill, shard_tokens)
        got += [start + c for c in closes]
        start = stop
    assert want == got
    assert fill == int(lengths.sum()) - int(lengths[:got[-1]].sum() if got else 0)


def test_unknown_engine_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="engine must be 'local' or 'ray'"):
        prepare(["x.jsonl"], out=tmp_path / "s", engine="spark")


def test_nothing_left_in_home_or_tmp(ray_cluster):
    # Ray's defaults (~/.ray/auth_token, /tmp/ray/session_*) stay untouched while it runs;
    # the fixture checks again after shutdown
    assert {p: p.exists() for p in LEFTOVERS} == LEFTOVERS_BEFORE


def test_a_transform_and_a_split_give_the_local_engines_stores(ray_cluster, tmp_path, corpus):
    # json:dumps (the whole record as text): importable on this running cluster's workers, which
    # were started before any test module existed; a user's module must be importable there too
    args = dict(transform="json:dumps", val_fraction=0.2, on_error="skip", progress=False,
                **SMALL)
    want = prepare([str(corpus)], out=tmp_path / "local", workers=2, **args)
    got = prepare([str(corpus)], out=tmp_path / "ray", engine="ray", **args)
    assert got == want and want["val"]["num_documents"] > 0
    for side in ("train", "val"):
        assert store_bytes(tmp_path / "ray" / side) == store_bytes(tmp_path / "local" / side)


# ---- SIGTERM (issue 22, class 9) ------------------------------------------------------------

def _own_ray_env(ray_tmp: str, base: dict[str, str]) -> dict[str, str]:
    """``base`` for a command starting its own private Ray instance, its files (and, in every
    process of it, this variable) under ``ray_tmp``."""
    env = {k: v for k, v in base.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_TOKEN=secrets.token_hex(32))
    return env


def _processes_with(marker: bytes) -> list[str]:
    """Live processes (zombies have ended) whose environment holds ``marker``: every process of
    one Ray instance inherits its RAY_TMPDIR. Each as "pid ppid command line"."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_bytes()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        state, ppid = stat[stat.rfind(b")") + 2:].split()[:2]
        if marker in environ.split(b"\0") and state != b"Z":
            found.append(f"{pid} {ppid.decode()} {cmd.decode(errors='replace')[:120]}")
    return found


def test_sigterm_stops_the_private_ray_instance_in_one_line_and_the_rerun_finishes(
        tmp_path, real_texts, bpe_tokenizer):
    corpus, env = held_corpus(tmp_path, real_texts)  # its last unit waits for env["TM_GO"]
    ray_tmp = tempfile.mkdtemp(prefix="tm-term-")  # short: Ray's socket paths must stay < 108
    env = _own_ray_env(ray_tmp, env)

    def command(out, *engine):
        return [sys.executable, "-m", "tokenmill", "prepare", str(corpus), "--out", str(out),
                "--tokenizer", bpe_tokenizer, "--shard-tokens", "30000", "--transform",
                "holdtext:text", "--workers", "2", *engine]

    cmd = command(tmp_path / "out", "--engine", "ray")
    try:
        run = OnTerminal(cmd, env)
        run.until(r"prepare:\s+[1-9]\d*%")  # working: its own bar has moved past 0%
        run.proc.send_signal(signal.SIGTERM)
        seen = run.finish()
        said = [ln for ln in run.lines() if ln.startswith("tokenmill prepare:")]
        assert (run.proc.returncode, said) == (143, [
            "tokenmill prepare: terminated (SIGTERM); run the same command again to resume"]), \
            seen[-3000:]
        assert run.lines()[-1] == said[0]
        assert "SIGTERM received" not in seen and "Traceback" not in seen, seen[-3000:]
        marker = f"RAY_TMPDIR={ray_tmp}".encode()
        assert _processes_with(marker) == []  # nothing of its Ray instance left running
        assert not (tmp_path / "out" / "manifest.json").exists()
        Path(env["TM_GO"]).touch()
        subprocess.run([*cmd, "--quiet"], env=env, check=True, timeout=600)  # the rerun finishes
        assert not (tmp_path / "out" / ".progress").exists() and _processes_with(marker) == []
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    ref = tmp_path / "ref"  # … as if never cut: the local engine's store, byte for byte
    subprocess.run(command(ref, "--quiet"), env=env, check=True, timeout=600)
    assert store_bytes(tmp_path / "out") == store_bytes(ref)

"""The command line: prepare → inspect → verify, exit codes and messages; every ordinary failure
is one line `tokenmill <command>: error: …`, never a traceback (issue 12, case 16)."""

import gzip
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_jsonl
from tokenmill.cli import main, ordinary_failure, say
from tokenmill.base.errors import StoreError


def run(*args):
    return subprocess.run([sys.executable, "-m", "tokenmill", *args], capture_output=True, text=True)


@pytest.fixture()
def store(tmp_path, real_texts):
    write_jsonl(tmp_path / "c.jsonl", real_texts[:40])
    out = tmp_path / "store"
    assert main(["prepare", str(tmp_path / "c.jsonl"), "--out", str(out), "--workers", "1",
                 "--shard-tokens", "100000", "--quiet"]) == 0
    return out


def test_inspect_text_json_and_plot(store, tmp_path, real_texts, capsys):
    assert main(["inspect", str(store)]) == 0
    text = capsys.readouterr().out
    assert "documents    40" in text and "bytes" in text and "sample" in text
    assert main(["inspect", str(store), "--json", "--plot", str(tmp_path / "h.png")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["documents"] == 40
    assert info["tokens"] == sum(len(t.encode()) + 1 for t in real_texts[:40])
    assert info["sample"] == real_texts[0].encode()[:64].decode("utf-8", "replace")
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_verify_ok_then_flipped_byte_then_truncation(store):
    r = run("verify", str(store))
    assert r.returncode == 0 and "OK" in r.stdout
    shard = sorted(store.glob("shard-*.bin"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    r = run("verify", str(store))
    assert r.returncode == 1 and f"{shard.name}: checksum mismatch" in r.stdout
    idx = sorted(store.glob("shard-*.idx"))[0]
    idx.write_bytes(idx.read_bytes()[:-3])
    r = run("verify", str(store))
    assert r.returncode == 1 and f"{idx.name}: expected" in r.stdout


def test_prepare_bad_input_exit_code_and_message(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n')
    r = run("prepare", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "s"), "--workers", "1")
    assert r.returncode == 2
    assert "bad.jsonl:2: malformed JSON" in r.stderr and "--on-error skip" in r.stderr
    r = run("prepare", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "s"), "--workers", "1",
            "--on-error", "skip")
    assert r.returncode == 0 and "skipped 1 (malformed_json 1)" in r.stderr


def test_inspect_refuses_unfinished_store(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "shard-00000.bin").write_bytes(b"")
    r = run("inspect", str(tmp_path / "s"))
    assert r.returncode == 2 and "prepare did not finish" in r.stderr


def test_plan_prints_the_buffer_memory():
    r = run("plan", "--seq-len", "2048", "--batch-size", "8", "--prefetch", "2")
    # (2 prefetched + 2 held) × 8 rows × 2048 × (inputs + targets, int32) = 0.50 MiB
    assert r.returncode == 0 and "batch ring           0.50 MiB" in r.stdout


def test_plan_says_which_row_filler_packs(store):
    r = run("plan", "--seq-len", "64", "--batch-size", "2", "--layout", "packed", "--store",
            str(store))
    assert r.returncode == 0 and "row filler     compiled" in r.stdout, r.stdout + r.stderr


def test_bench_unknown_name_is_a_clear_error(store):
    r = run("bench", str(store), "--only", "nosuchloader")
    assert r.returncode == 2 and "nosuchloader" in r.stderr and "naive" in r.stderr


# ---- issue 12 (16): ordinary failures are one line, never a traceback ---------------------------
# Each case runs the installed `tokenmill` command as a user would (a subprocess, cwd = a fresh
# folder, relative paths) and, where there is one, the same call through the Python API in a script
# file: the API raises a TokenmillError whose text is the CLI's line.

TOKENMILL = Path(sys.executable).with_name("tokenmill")  # the venv's console script


def cli(*args, cwd, prefix=(), timeout=300):
    """The real `tokenmill` command, run in ``cwd`` (after ``prefix``, e.g. an unshare)."""
    return subprocess.run([*prefix, str(TOKENMILL), *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def error_line(r, command: str) -> str:
    """The one line a failed command printed: no traceback, nothing else on stderr."""
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith(f"tokenmill {command}: error: "), lines[0]
    assert r.returncode in (1, 2), (r.returncode, lines[0])
    return lines[0]


API = """\
import json, tokenmill
from tokenmill.base.errors import TokenmillError
from tokenmill.interchange import export
try:
    {call}
except TokenmillError as e:
    print(json.dumps([type(e).__name__, str(e)]))
else:
    print("null")
"""


def api_error(call: str, *, cwd: Path, prefix=()) -> tuple[str, str] | None:
    """(type, message) of the TokenmillError that ``call`` raises in a script file run in ``cwd``;
    None if it returns; any other exception fails the test with its traceback."""
    script = cwd / "api_call.py"
    script.write_text(API.format(call=call))
    r = subprocess.run([*prefix, sys.executable, str(script)], cwd=cwd, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    script.unlink()
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture()
def site(tmp_path, real_texts):
    """A user's folder: c.jsonl, a finished store `store`, and a plain file `afile`."""
    write_jsonl(tmp_path / "c.jsonl", real_texts[:20])
    r = cli("prepare", "c.jsonl", "--out", "store", "--workers", "1", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (tmp_path / "afile").write_text("not a folder\n")
    return tmp_path


@pytest.fixture()
def read_only(site):
    """(folder `ro` in ``site``, command prefix) such that nothing can be written under `ro`: as
    root, whom mode bits do not stop, a read-only tmpfs mounted on it in a private mount
    namespace (it vanishes with the command); otherwise mode 0o555."""
    ro = site / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        yield ro, ()
        ro.chmod(0o755)
        return
    prefix = ("unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o ro tmpfs "$0" && exec "$@"',
              str(ro))
    probe = subprocess.run([*prefix, "touch", str(ro / "x")], capture_output=True, text=True)
    if "Read-only file system" not in probe.stderr:
        pytest.skip(f"cannot mount a read-only tmpfs here: {probe.stderr.strip()}")
    yield ro, prefix


PREPARE = 'tokenmill.prepare("c.jsonl", out={out!r}, workers=1, progress=False)'
EXPORT = 'export("store", out={out!r}, format="nanogpt", progress=False)'

# (command, the flag's value, the API call, the path the message must name)
FAILURES = {
    "prepare --out an existing file": ("prepare", "afile", PREPARE, "afile: is a file, not a folder"),
    "prepare --out under a file": ("prepare", "afile/sub", PREPARE, "afile/sub"),
    "export --out under a file": ("export", "afile/x.bin", EXPORT, "afile/x.bin"),
}


def cli_argv(command: str, out: str) -> list[str]:
    if command == "prepare":
        return ["prepare", "c.jsonl", "--out", out, "--workers", "1", "--quiet"]
    return ["export", "store", "--format", "nanogpt", "--out", out, "--quiet"]


@pytest.mark.parametrize("case", list(FAILURES))
def test_a_bad_out_is_one_line_naming_it(site, case):
    command, out, call, named = FAILURES[case]
    before = (site / "afile").read_text()
    line = error_line(cli(*cli_argv(command, out), cwd=site), command)
    assert named in line
    assert (site / "afile").read_text() == before  # the user's file is untouched


@pytest.mark.parametrize("case", list(FAILURES))
def test_the_api_raises_the_same_text_as_a_tokenmill_error(site, case):
    command, out, call, named = FAILURES[case]
    line = error_line(cli(*cli_argv(command, out), cwd=site), command)
    raised = api_error(call.format(out=out), cwd=site)
    assert raised is not None, f"{call} returned instead of raising"
    assert named in raised[1]
    assert line == f"tokenmill {command}: error: {raised[1]}"


@pytest.mark.parametrize("command", ["prepare", "export"])
def test_out_on_a_read_only_filesystem_is_one_line_naming_it(site, read_only, command):
    ro, prefix = read_only
    out = "ro/store" if command == "prepare" else "ro/x.bin"
    line = error_line(cli(*cli_argv(command, out), cwd=site, prefix=prefix), command)
    assert out in line and ("Read-only file system" in line or "ermission denied" in line), line
    raised = api_error((PREPARE if command == "prepare" else EXPORT).format(out=out), cwd=site,
                       prefix=prefix)
    assert raised is not None and out in raised[1]
    assert line == f"tokenmill {command}: error: {raised[1]}"


def test_export_into_a_missing_folder_writes_it_or_names_it(site):
    r = cli("export", "store", "--format", "nanogpt", "--out", "new/dir/x.bin", "--quiet",
            cwd=site)
    if r.returncode == 0:  # made the folders: the file holds every token, as uint16
        tokens = json.loads(cli("inspect", "store", "--json", cwd=site).stdout)["tokens"]
        assert (site / "new/dir/x.bin").stat().st_size == 2 * tokens
    else:
        assert "new/dir" in error_line(r, "export")


def test_a_stray_shard_named_file_in_out_is_left_alone_or_named(site):
    out = site / "st"
    out.mkdir()
    (out / "shard-notes.txt").write_text("my notes\n")
    r = cli("prepare", "c.jsonl", "--out", "st", "--workers", "1", "--quiet", cwd=site)
    assert (out / "shard-notes.txt").read_text() == "my notes\n"  # never deleted, never changed
    if r.returncode == 0:
        assert "Traceback" not in r.stderr
        assert cli("verify", "st", cwd=site).returncode == 0
    else:
        assert "shard-notes.txt" in error_line(r, "prepare")


@pytest.mark.parametrize("names, them", [(["shard-00007.bin"], "it"),
                                         (["shard-00007.bin", "shard-00007.idx"], "them")])
def test_stray_shard_files_are_refused_in_the_right_number(site, names, them):
    out = site / "st"
    out.mkdir()
    for name in names:
        (out / name).write_bytes(b"not ours")
    line = error_line(cli(*cli_argv("prepare", "st"), cwd=site), "prepare")
    assert f"st: holds {', '.join(names)}, which" in line
    assert f"cannot tell that it wrote {them} and will not delete or overwrite {them}; " \
           f"move {them} away" in line
    assert all((out / n).read_bytes() == b"not ours" for n in names)


def test_inspect_into_a_closed_pipe_is_silent(site):
    # the reader has gone before tokenmill writes: deterministic EPIPE
    p = subprocess.Popen([str(TOKENMILL), "inspect", "store"], cwd=site, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) in (0, 141) and err == ""
    # and as a user types it; whichever way the race goes, head prints the first line only
    r = subprocess.run(f"{TOKENMILL} inspect store | head -1", shell=True, cwd=site,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "" and r.stdout == "store        store\n"


def test_plan_packed_without_a_store_refuses_instead_of_0_bytes(site):
    r = cli("plan", "--seq-len", "128", "--batch-size", "4", "--layout", "packed", cwd=site)
    line = error_line(r, "plan")
    assert r.returncode == 2 and "--store" in line and "0 documents" not in r.stdout
    r = cli("plan", "--seq-len", "128", "--batch-size", "4", "--layout", "packed", "--store",
            "store", cwd=site)
    assert r.returncode == 0 and "packed windows" in r.stdout and "(at most, 20 documents)" in r.stdout


def test_a_usage_error_is_one_line_too(site):
    r = cli("plan", "--seq-len", "x", "--batch-size", "4", cwd=site)
    assert r.returncode == 2
    assert r.stderr == ("tokenmill plan: error: argument --seq-len: invalid int value: 'x' "
                        "(see 'tokenmill plan --help')\n")


def write_huge_line_gz(path: Path, line_bytes: int) -> Path:
    """A .jsonl.gz whose line 2 is one document of ``line_bytes`` bytes (a few MB on disk)."""
    chunk = b"x" * (64 << 20)
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(b'{"text": "a small first document"}\n{"text": "')
        for _ in range(line_bytes // len(chunk)):
            f.write(chunk)
        f.write(b'"}\n')
    return path


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_line_too_big_for_memory_names_the_file_and_line(tmp_path, workers):
    # 1 GiB on one line under a 512 MiB address-space limit: tokenmill itself runs in < 300 MiB
    write_huge_line_gz(tmp_path / "big.jsonl.gz", 1 << 30)
    limit = ("prlimit", f"--as={512 << 20}")
    r = cli("prepare", "big.jsonl.gz", "--out", "s", "--workers", workers, "--quiet",
            cwd=tmp_path, prefix=limit)
    line = error_line(r, "prepare")
    assert re.search(r"big\.jsonl\.gz:2\b|big\.jsonl\.gz.*line 2\b", line), line
    call = f'tokenmill.prepare("big.jsonl.gz", out="s2", workers={workers}, progress=False)'
    raised = api_error(call, cwd=tmp_path, prefix=limit)
    assert raised is not None and raised[0] == "InputError"
    assert line == f"tokenmill prepare: error: {raised[1]}"


def test_inspect_an_s3_store_prints_its_url_unchanged(site, s3):
    url = s3.put_dir(site / "store", "store")
    r = cli("inspect", url, cwd=site)
    assert r.returncode == 0, r.stderr
    assert f"store        {url}\n" in r.stdout  # not s3:/bucket/store
    r = cli("inspect", url, "--json", cwd=site)
    assert json.loads(r.stdout)["path"] == url
    missing = s3.url("no-store-here")
    assert missing in error_line(cli("inspect", missing, cwd=site), "inspect")


def test_ordinary_failures_are_one_line_and_bugs_keep_their_traceback(capsys):
    assert ordinary_failure("prepare", KeyboardInterrupt()) == 130
    assert ordinary_failure("inspect", StoreError("s: not a store")) == 2
    assert ordinary_failure("export", PermissionError(13, "Permission denied", "ro/x")) == 1
    assert ordinary_failure("prepare", MemoryError()) == 1
    assert capsys.readouterr().err.splitlines() == [
        "tokenmill prepare: interrupted; run the same command again to resume",
        "tokenmill inspect: error: s: not a store",
        "tokenmill export: error: ro/x: Permission denied",
        "tokenmill prepare: error: out of memory; give it more memory or fewer --workers"]
    assert ordinary_failure("prepare", ValueError("a bug")) is None  # main re-raises it
    assert ordinary_failure("verify", KeyboardInterrupt()) == 130  # nothing to resume there
    assert capsys.readouterr().err == "tokenmill verify: interrupted\n"


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_warning_is_one_line_naming_the_command(tmp_path, workers):
    # one document of 72 MiB of text (a jsonl line): warned about where it is read — in a worker
    # process too (its stderr is not the user's: the pool hands its warnings to the parent)
    with open(tmp_path / "big.jsonl", "w") as f:
        f.write(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "ab " * (24 << 20)}) + "\n")
    r = cli("prepare", "big.jsonl", "--out", "store", "--workers", workers, "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.splitlines() == [
        f"tokenmill prepare: warning: big.jsonl: a single document of {3 * (24 << 20):,} "
        f"characters, tokenized whole in memory (~{3 * (24 << 20) // 4:,} tokens of a typical "
        "BPE); cut such documents into smaller ones (.txt: --txt-mode lines or paragraphs)"]


def test_error_lines_carry_no_credentials_and_no_newlines(capsys):
    say("prepare", "error: https://ann:hunter2@host/x.jsonl: gone\n  try again", 2)
    assert capsys.readouterr().err == ("tokenmill prepare: error: https://ann:***@host/x.jsonl: "
                                       "gone | try again\n")


@pytest.mark.parametrize("keys", [{}, {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}],
                         ids=["no credentials", "no server"])
def test_an_s3_store_out_of_reach_is_one_line_naming_it(tmp_path, keys):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_ENDPOINT_URL="http://127.0.0.1:9", HF_HUB_OFFLINE="1", **keys)  # port 9: nobody
    r = subprocess.run([str(TOKENMILL), "inspect", "s3://b/store"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert "s3://b/store" in error_line(r, "inspect")


def test_sigterm_ends_prepare_as_ctrl_c_does_in_one_line_and_the_rerun_finishes(
        tmp_path, real_texts, bpe_tokenizer):
    from conftest import OnTerminal, held_corpus, store_bytes
    corpus, env = held_corpus(tmp_path, real_texts)  # its last unit waits for env["TM_GO"]

    def command(out, *quiet):
        return [str(TOKENMILL), "prepare", str(corpus), "--out", str(out), "--tokenizer",
                bpe_tokenizer, "--shard-tokens", "30000", "--workers", "2", "--transform",
                "holdtext:text", *quiet]

    cmd = command(tmp_path / "out")
    run = OnTerminal(cmd, env)
    run.until(r"prepare:\s+[1-9]\d*%")  # working: its own bar has moved past 0%
    run.proc.send_signal(signal.SIGTERM)
    seen = run.finish()
    assert (run.proc.returncode, run.lines()[-1]) == (
        143, "tokenmill prepare: terminated (SIGTERM); run the same command again to resume"), seen
    assert "Traceback" not in seen and len([ln for ln in run.lines() if "tokenmill" in ln]) == 1
    workers = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p)[-3:-2] ==
               ["tokenmill.base.child"] and _cmdline(p)[-1] == str(run.proc.pid)]
    assert workers == []  # its worker processes ended with it
    Path(env["TM_GO"]).touch()
    subprocess.run([*cmd, "--quiet"], env=env, check=True, timeout=600)  # the rerun finishes …
    subprocess.run(command(tmp_path / "ref", "--quiet"), env=env, check=True, timeout=600)
    assert store_bytes(tmp_path / "out") == store_bytes(tmp_path / "ref")  # … as if never cut


def _cmdline(pid: str) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []

"""The command line: ``tokenmill prepare | inspect | verify | import-megatron | export | bench |
plan | resume-check | explain | demo``.

An ordinary failure is one line on stderr and an exit code, never a traceback:

    tokenmill prepare: error: bad.jsonl:2: malformed JSON …   exit 2  (a TokenmillError; usage)
    tokenmill export: error: /ro/x.bin: Read-only file system  exit 1  (an OSError)
    tokenmill prepare: interrupted; run the same command again to resume  exit 130 (Ctrl-C)
    tokenmill prepare: warning: a.txt: 70,000,000 bytes of text …  (a warning: one line, goes on)
    (nothing)                                                   exit 141 (stdout closed: | head)

Anything else is a bug in tokenmill and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import contextlib
import select
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from tokenmill.base.errors import ConfigError, Terminated, TokenmillError, is_int, os_error_text, redact

USAGE_EXIT = 2  # argparse's code; also every TokenmillError (a refusal that says what to do)
FAILED_EXIT = 1  # the system said no: a read-only disk, a missing folder, out of memory
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports Ctrl-C
CLOSED_STDOUT_EXIT = 141  # 128 + SIGPIPE, as `yes | head -1` leaves `yes`


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line: ``tokenmill plan: error: … (see --help)``."""

    def error(self, message: str):
        """Print the one line and exit 2."""
        self.exit(USAGE_EXIT, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 done, 1 failed, 2 refused, 130, 141, 143)."""
    args = build_parser().parse_args(argv)
    try:
        with one_line_warnings(args.command):
            code = args.run(args)
        sys.stdout.flush()  # a reader that went away shows here, inside the try, not at exit
        return code
    except (Exception, KeyboardInterrupt, Terminated) as e:
        code = ordinary_failure(args.command, e)
        if code is None:
            raise  # a bug: the traceback is what a report needs
        return code


def ordinary_failure(command: str, error: BaseException) -> int | None:
    """Say ``error`` in one line and return the exit code; None when it is a bug."""
    if isinstance(error, BrokenPipeError) and stdout_closed():
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # quiet exit-time flush
        return CLOSED_STDOUT_EXIT
    if isinstance(error, (KeyboardInterrupt, Terminated)):
        resume = "; run the same command again to resume" if command == "prepare" else ""
        term = isinstance(error, Terminated)
        return say(command, ("terminated (SIGTERM)" if term else "interrupted") + resume,
                   error.code if term else INTERRUPTED_EXIT)
    if isinstance(error, TokenmillError):
        return say(command, f"error: {error}", USAGE_EXIT)
    if isinstance(error, OSError):
        return say(command, f"error: {os_error_text(error)}", FAILED_EXIT)
    if isinstance(error, MemoryError):
        detail = f" ({error})" if str(error) else ""
        return say(command, f"error: out of memory{detail}; give it more memory or fewer "
                   "--workers", FAILED_EXIT)
    return None


@contextlib.contextmanager
def one_line_warnings(command: str) -> Iterator[None]:
    """While a command runs, a warning is one line ``tokenmill <command>: warning: <message>``."""
    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message).removeprefix("tokenmill: ")
        say(command, f"warning: {text}", 0)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def say(command: str, message: str, code: int) -> int:
    """Print ``tokenmill <command>: <message>`` as one line (credentials redacted); ``code``."""
    line = " | ".join(part.strip() for part in str(message).splitlines() if part.strip())
    try:
        print(f"tokenmill {command}: {redact(line)}", file=sys.stderr, flush=True)
    except OSError:
        pass  # stderr is gone too: the exit code is all that can still be said
    return code


def stdout_closed() -> bool:
    """True when stdout is a pipe whose reader has gone (``tokenmill inspect S | head -1``)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):
        return False
    poller = select.poll()
    poller.register(fd, 0)  # no events asked: only POLLERR / POLLHUP / POLLNVAL come back
    return any(events & select.POLLERR for _, events in poller.poll(0))


# ---- the parser -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; each subcommand's ``run`` default is its function."""
    p = Parser(prog="tokenmill", description="Keep accelerators fed: tokenize text into a "
               "memory-mapped store, load exact batches.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (add_prepare, add_inspect, add_verify, add_import_megatron, add_export, add_bench,
                add_plan, add_resume_check, add_explain, add_demo):
        add(sub)
    return p


def subcommand(sub, name: str, run, help: str) -> argparse.ArgumentParser:
    """The parser of ``tokenmill <name>``, whose ``run`` default is ``run``."""
    parser = sub.add_parser(name, help=help)
    parser.set_defaults(run=run)
    return parser


def add_quiet(parser: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress output."""
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def _int_or_auto(value: str) -> int | str:
    return value if value == "auto" else int(value)


def _int_or_none(value: str) -> int | None:
    return None if value == "none" else int(value)


def add_prepare(sub) -> None:
    """``tokenmill prepare``."""
    from tokenmill.inputs.textfields import add_arguments as add_text_arguments
    pp = subcommand(sub, "prepare", run_prepare, "tokenize text files into a token store")
    pp.add_argument("inputs", nargs="+", metavar="INPUT",
                    help="files, directories, globs or URLs (.txt .jsonl[.gz|.zst] "
                    ".json[.gz|.zst] .csv .tsv .parquet, Hugging Face datasets saved with "
                    "save_to_disk, hf://datasets/ORG/NAME)")
    pp.add_argument("--out", required=True, help="store directory to create (or resume)")
    pp.add_argument("--tokenizer", default="bytes",
                    help="'bytes' (default), a tokenizer file (tokenizer.json, .tiktoken, "
                    "sentencepiece .model, recognised by content), a folder, a tiktoken name "
                    "(gpt2, cl100k_base, o200k_base, …) or a Hub id org/name[@revision]")
    pp.add_argument("--workers", type=_int_or_auto, default="auto",
                    help="worker processes (default auto: in this process when the tokenizer engine "
                         "uses every core itself (fastokens), else one per core)")
    pp.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (default 2^26)")
    add_text_arguments(pp)  # --text-key, --text-ext
    pp.add_argument("--split", default=None, metavar="NAME", help="the split to take from a "
                    "folder holding several (a DatasetDict, a Hub dataset): required there")
    pp.add_argument("--txt-mode", choices=["file", "lines", "paragraphs"], default="file",
                    help="one document per .txt file (default), per line, or per paragraph")
    pp.add_argument("--on-error", choices=["raise", "skip"], default="raise",
                    help="stop at the first bad input (default) or skip and count it")
    pp.add_argument("--no-eos", action="store_true", help="do not append EOS to documents")
    pp.add_argument("--bos", action="store_true", help="prepend BOS to every document")
    pp.add_argument("--eos-token", default=None, help="EOS token string, if not detected")
    pp.add_argument("--no-fast-tokenizer", action="store_true",
                    help="never swap a tokenizer.json for its equivalent tiktoken encoding")
    pp.add_argument("--tokenizer-engine", choices=["auto", "fastokens", "tiktoken", "hf"],
                    default="auto", help="what runs a tokenizer.json: the fastest engine proven "
                    "to give tokenizers' ids (auto, default) or that one; the same store")
    pp.add_argument("--transform", default=None, metavar="MODULE:FUNCTION",
                    help="fn(record: dict) -> str | None makes each record's text (None drops it); "
                    "MODULE is imported from the current folder or PYTHONPATH")
    pp.add_argument("--val-fraction", type=float, default=None, metavar="F",
                    help="write OUT/train and OUT/val, holding out F of the documents (by a hash "
                    "of their text: the same split for any workers, resume or grown corpus)")
    pp.add_argument("--overwrite", action="store_true", help="replace a different store at --out")
    pp.add_argument("--engine", choices=["local", "ray"], default="local",
                    help="local processes (default) or Ray tasks (pip install 'tokenmill[ray]'); "
                    "the same store, byte for byte")
    pp.add_argument("--ray-address", default=None, metavar="auto|HOST:PORT",
                    help="--engine ray: the cluster to join (default: $RAY_ADDRESS, else a "
                    "private Ray instance on this machine with --workers CPUs)")
    add_quiet(pp)


def add_inspect(sub) -> None:
    """``tokenmill inspect``."""
    pi = subcommand(sub, "inspect", run_inspect, "describe a store")
    pi.add_argument("store")
    pi.add_argument("--json", action="store_true", help="print JSON instead of text")
    pi.add_argument("--plot", metavar="FILE.png", help="write a histogram of document lengths")
    pi.add_argument("--seq-len", type=int, default=None, metavar="N",
                    help="also pack the store into rows of N + 1 tokens and report the padding")
    pi.add_argument("--max-segments", type=int, default=None, metavar="M",
                    help="with --seq-len: at most M documents a row")


def add_verify(sub) -> None:
    """``tokenmill verify``."""
    pv = subcommand(sub, "verify", run_verify, "check a store's structure and every checksum")
    pv.add_argument("store")


def add_import_megatron(sub) -> None:
    """``tokenmill import-megatron``."""
    pm = subcommand(sub, "import-megatron", run_import_megatron, "make a store of Megatron-LM "
                    ".bin/.idx datasets (the .bin files are hard-linked, not copied)")
    pm.add_argument("prefixes", nargs="+", metavar="PREFIX", help="dataset prefix of PREFIX.bin/.idx")
    pm.add_argument("--out", required=True, help="store directory to create (new or empty)")
    pm.add_argument("--tokenizer", required=True,
                    help="the tokenizer the data was made with: 'bytes', a tokenizer.json, a "
                    ".tiktoken file or a .model file")
    pm.add_argument("--link", choices=["hard", "symlink", "copy"], default="hard",
                    help="hard link (default; a symlink when that fails, e.g. across filesystems), "
                    "symlink, or copy the .bin files")
    add_quiet(pm)


def add_export(sub) -> None:
    """``tokenmill export``."""
    pe = subcommand(sub, "export", run_export,
                    "write a store as nanoGPT's train.bin (+ val.bin, meta.pkl) or as JSONL text")
    pe.add_argument("store")
    pe.add_argument("--format", required=True, choices=["nanogpt", "jsonl"],
                    help="nanogpt: flat uint16 token ids; jsonl: one {\"text\": …} per document")
    pe.add_argument("--out", required=True, help="file to write (atomically); a split: a folder")
    pe.add_argument("--tokenizer", default=None,
                    help="jsonl: the store's tokenizer, if not at the path its manifest records")
    add_quiet(pe)


def add_bench(sub) -> None:
    """``tokenmill bench``."""
    from tokenmill.observe.bench import add_arguments  # numpy and the peers' registry: only when asked
    pb = subcommand(sub, "bench", run_bench, "compare tokenmill with other loaders on a store")
    add_arguments(pb)


def add_plan(sub) -> None:
    """``tokenmill plan``."""
    pl = subcommand(sub, "plan", run_plan, "memory the loader's buffers take for a config")
    pl.add_argument("--seq-len", type=int, required=True)
    pl.add_argument("--batch-size", type=int, required=True)
    pl.add_argument("--layout", choices=["concat", "packed"], default="concat")
    pl.add_argument("--dtype", choices=["int32", "int64"], default="int32")
    pl.add_argument("--prefetch", type=int, default=2)
    pl.add_argument("--store", default=None, help="a store, to size the packed layout "
                    "(required with --layout packed)")


def add_resume_check(sub) -> None:
    """``tokenmill resume-check``."""
    pr = subcommand(sub, "resume-check", run_resume_check,
                    "say whether a saved loader state resumes exactly on these stores and settings")
    pr.add_argument("state", help="a Loader's state_dict() saved as JSON")
    pr.add_argument("stores", nargs="+", help="STORE, or NAME=STORE for named stores (in order)")
    saved = " (default: the state's, as the run had it)"
    pr.add_argument("--seq-len", type=int, default=None, help="the new run's" + saved)
    pr.add_argument("--batch-size", type=int, default=None, help="the new run's" + saved)
    pr.add_argument("--layout", choices=["concat", "packed"], default=None, help=saved.strip())
    pr.add_argument("--seed", type=int, default=None, help=saved.strip())
    pr.add_argument("--world-size", type=int, default=None, help=saved.strip())
    pr.add_argument("--max-segments", type=int, default=None, help=saved.strip())
    pr.add_argument("--mixture", default=None, help="named stores: the phases as JSON (or a "
                    "Python literal), [[0, {\"web\": 0.9, \"code\": 0.1}], …] (default: the "
                    "state's)")


def add_explain(sub) -> None:
    """``tokenmill explain``."""
    pe = subcommand(sub, "explain", run_explain,
                    "where each row of a step came from: store, shard, document, token offset, "
                    "input file and line (or row)")
    pe.add_argument("stores", nargs="+", help="STORE, or NAME=STORE for named stores (in order)")
    pe.add_argument("--step", type=int, required=True, help="the training step (0-based)")
    pe.add_argument("--rank", type=int, default=0, help="the rank whose rows to explain")
    pe.add_argument("--state", default=None, help="the run's Loader.state_dict() saved as JSON: "
                    "every setting below as the run had it (else each must be given)")
    run = dict(default=argparse.SUPPRESS, help="as the run had it (none is assumed)")
    pe.add_argument("--seq-len", type=int, **run)
    pe.add_argument("--batch-size", type=int, **{**run, "help": "per rank, as the run had it"})
    pe.add_argument("--layout", choices=["concat", "packed"], **run)
    pe.add_argument("--seed", type=int, **run)
    pe.add_argument("--world-size", type=int, **run)
    pe.add_argument("--max-segments", type=_int_or_none, **{**run, "help": "packed: N, or none"})
    pe.add_argument("--weights", **{**run, "help": "several unnamed stores: 0.7,0.3 (in order)"})
    pe.add_argument("--mixture", **{**run, "help": "named stores: the phases as JSON (or a "
                                    "Python literal)"})


def add_demo(sub) -> None:
    """``tokenmill demo``."""
    pd = subcommand(sub, "demo", run_demo, "the end-to-end demo on built-in data")
    pd.add_argument("--out", default="demo-out", help="working directory (default demo-out)")
    pd.add_argument("--quick", action="store_true", help="a smaller, faster run")


# ---- the commands -----------------------------------------------------------------------------

def run_prepare(args) -> int:
    """Tokenize the inputs into a store."""
    from tokenmill.prepare import prepare
    from tokenmill.base.procs import sigterm_exits
    options = dict(text_key=args.text_key, txt_mode=args.txt_mode, on_error=args.on_error,
                   add_eos=not args.no_eos, add_bos=args.bos, eos=args.eos_token,
                   tokenizer_engine="hf" if args.no_fast_tokenizer else args.tokenizer_engine,
                   split=args.split, text_ext=args.text_ext)
    if args.shard_tokens is not None:
        options["shard_tokens"] = args.shard_tokens
    if args.transform is not None:
        sys.path.insert(0, os.getcwd())  # as `python -m` does; workers get this path too
        options["transform"] = args.transform
    with sigterm_exits():  # SIGTERM ends it as Ctrl-C does: cleaned up, one line, exit 143
        prepare(args.inputs, out=args.out, tokenizer=args.tokenizer, workers=args.workers,
                progress=False if args.quiet else None, overwrite=args.overwrite,
                engine=args.engine, ray_address=args.ray_address, val_fraction=args.val_fraction,
                **options)
    return 0


def run_inspect(args) -> int:
    """Describe a store (text or JSON), optionally plotting its document lengths."""
    from tokenmill.observe.inspection import (describe, format_description, format_packing,
                                              packing_quality, plot_lengths)
    info = describe(args.store)
    if args.seq_len is not None:
        info["packing"] = packing_quality(args.store, args.seq_len, args.max_segments)
    text = format_description(info) + ("\n" + format_packing(info["packing"])
                                       if "packing" in info else "")
    print(json.dumps(info, indent=1) if args.json else text)
    if args.plot:
        plot_lengths(args.store, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def run_verify(args) -> int:
    """Check a store; 1 and one BAD line per problem when it is damaged."""
    from tokenmill.store import verify_store
    problems = verify_store(args.store)
    if problems:
        for line in problems:
            print(f"BAD  {line}")
        print(f"{redact(args.store)}: {len(problems)} problem(s) found")
        return 1
    print(f"{redact(args.store)}: OK (structure and every checksum verified)")
    return 0


def run_import_megatron(args) -> int:
    """Make a store of Megatron-LM datasets."""
    from tokenmill.interchange import import_megatron
    from tokenmill.prepare import summary_line
    manifest = import_megatron(args.prefixes, out=args.out, tokenizer=args.tokenizer,
                               link=args.link, progress=False if args.quiet else None)
    if not args.quiet:
        links = ", ".join(sorted(set(manifest["settings"]["links"])))
        print(f"{summary_line(manifest)}; .bin files: {links}", file=sys.stderr)
    return 0


def run_export(args) -> int:
    """Write a store as nanoGPT's train.bin or as JSONL."""
    from tokenmill.interchange import export
    done = export(args.store, out=args.out, format=args.format, tokenizer=args.tokenizer,
                  progress=False if args.quiet else None)
    if not args.quiet:
        print(f"wrote {', '.join(done['files'])}: {done['documents']:,} documents, "
              f"{done['tokens']:,} tokens, {done['bytes']:,} bytes", file=sys.stderr)
    return 0


def run_bench(args) -> int:
    """Compare loaders on a store."""
    from tokenmill.observe.bench import run_from_args
    return run_from_args(args)


def run_plan(args) -> int:
    """Print the memory the loader's buffers take for a config."""
    from tokenmill.load.loader import PREFETCH_MEMORY_BUDGET, memory_plan
    if args.layout == "packed" and not args.store:
        raise ConfigError("--layout packed needs --store STORE: the packed plan's size "
                          "depends on the store's document lengths")
    from tokenmill.load import fastpath, packing
    from tokenmill.store import read_manifest
    m = read_manifest(args.store) if args.store else {"num_documents": 0, "num_tokens": 0}
    packed = packing.window_memory(m["num_documents"], m["num_tokens"], args.seq_len)
    plan = memory_plan(seq_len=args.seq_len, batch_size=args.batch_size, layout=args.layout,
                       dtype=args.dtype, prefetch=args.prefetch, packed_bytes=packed)
    print(f"batch ring     {plan['batch_ring'] / 2**20:10.2f} MiB  "
          f"({args.prefetch} prefetched + 2 held batches of {args.batch_size}×{args.seq_len})")
    if args.layout == "packed":
        print(f"packed windows {plan['packed_layout'] / 2**20:10.2f} MiB  (at most, "
              f"{m['num_documents']:,} documents)\nrow filler     {fastpath.status()}")
    print(f"total          {plan['total'] / 2**20:10.2f} MiB  (prefetch=\"auto\" grows within "
          f"{PREFETCH_MEMORY_BUDGET / 2**30:.0f} GiB)")
    return 0


def _resume_source(stores: list[str], saved: dict, mixture: str | None):
    """The Loader source and mixture= of ``resume-check``'s store arguments."""
    named = [_named_store(s) for s in stores]
    if all(named):
        from tokenmill.load.mixture import phases_from_text
        phases = phases_from_text(mixture) if mixture is not None else saved.get("mixture")
        if phases is None:
            raise ConfigError("named stores need the mixture phases: pass --mixture, or a state "
                              "saved by a loader with mixture=")
        return dict(named), phases
    weights = saved.get("weights") or []
    if len(weights) != len(stores):
        weights = [1.0] * len(stores)
    return (stores[0] if len(stores) == 1 else dict(zip(stores, weights))), None


def _named_store(arg: str) -> tuple[str, str] | None:
    """``NAME=STORE`` as (name, store); None for a store path, even one holding "=" (an existing
    path, or "=" after a "/": ``runs/lr=3e-4/store``, ``s3://b/k=v``)."""
    name, sep, path = arg.partition("=")
    if not sep or not name or "/" in name or os.path.exists(arg):
        return None
    return name, path


def _resume_settings(args, saved: dict) -> dict:
    """The Loader settings resume-check tries: each flag given, else the state's record of the
    run (``stream``), else the Loader's default; seq_len and batch_size must come from one."""
    given = {"seq_len": args.seq_len, "batch_size": args.batch_size, "layout": args.layout,
             "seed": args.seed, "world_size": args.world_size, "max_segments": args.max_segments}
    settings = {k: saved.get(k) if v is None else v for k, v in given.items()}
    if missing := [k for k in ("seq_len", "batch_size") if settings[k] is None]:
        flags = " and ".join("--" + k.replace("_", "-") for k in missing)
        raise ConfigError(f"{args.state} does not record {' and '.join(missing)} (a state saved "
                          f"before loaders recorded their settings): pass {flags} as the run "
                          "had them")
    defaults = {"layout": "concat", "seed": 0, "world_size": 1}
    settings.update({k: v for k, v in defaults.items() if settings[k] is None})
    workers = saved.get("num_workers")  # as saved: not a difference to report (nothing iterates)
    settings["num_workers"] = workers if is_int(workers) and workers >= 0 else 0
    return settings


def run_resume_check(args) -> int:
    """Print how a saved state and a loader over these stores differ; 0 if it resumes exactly."""
    from tokenmill.load.loader import Loader
    from tokenmill.load.resume import read_state
    state = read_state(args.state)
    saved = state.get("stream") if isinstance(state.get("stream"), dict) else {}
    source, mixture = _resume_source(args.stores, saved, args.mixture)
    with Loader(source, rank=0, mixture=mixture, **_resume_settings(args, saved)) as loader:
        diffs = loader.resume_report(state)
        for d in diffs:
            print(f"{'safe' if d.safe else 'NOT SAFE':9} {d.what}")
        try:
            loader.load_state_dict(state)
        except ConfigError as e:
            print(f"does not resume exactly: {e}")
            return FAILED_EXIT
    print(f"resumes exactly at consumed_samples={state['consumed_samples']:,}")
    return 0


def run_explain(args) -> int:
    """Print the origin of every row of one step of the run, one document piece a line."""
    from tokenmill.load.loader import Loader
    from tokenmill.load.mixture import phases_from_text, weights_from_text
    from tokenmill.load.resume import RUN_KEYS, read_state, run_settings, same_run
    state = read_state(args.state) if args.state else {}
    named = [_named_store(s) for s in args.stores]
    given = {k: v for k, v in vars(args).items() if k in RUN_KEYS}  # flags not given: absent
    given |= {k: f(given[k]) for k, f in (("weights", weights_from_text),
                                         ("mixture", phases_from_text)) if k in given}
    settings = run_settings(state, given, stores=len(named), named=all(named), where=args.state)
    weights, mixture = settings.pop("weights", None), settings.pop("mixture", None)
    source = dict(named) if all(named) else dict(zip(args.stores, weights)) if weights \
        else args.stores[0]
    with Loader(source, rank=args.rank, num_workers=0, mixture=mixture, **settings) as loader:
        if args.state:
            same_run(state, loader.describe(), loader.fingerprint, args.state)
        for o in loader.explain(args.step):
            print("\n".join(o.lines()))
    return 0


def run_demo(args) -> int:
    """The end-to-end demo."""
    from tokenmill.demo import run_demo as demo
    demo(Path(args.out), quick=args.quick)
    return 0

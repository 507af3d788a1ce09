"""The command line: ``tokenmill prepare | inspect | verify | import-megatron | export | bench |
plan | demo``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenmill.errors import TokenmillError


def _int_or_auto(value: str) -> int | str:
    return value if value == "auto" else int(value)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill", description="Keep accelerators fed: "
                                "tokenize text into a memory-mapped store, load exact batches.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pp = sub.add_parser("prepare", help="tokenize text files into a token store")
    pp.add_argument("inputs", nargs="+", metavar="INPUT",
                    help="files, directories, globs or URLs (.txt .jsonl[.gz|.zst] .parquet, "
                    "Hugging Face datasets saved with save_to_disk)")
    pp.add_argument("--out", required=True, help="store directory to create (or resume)")
    pp.add_argument("--tokenizer", default="bytes",
                    help="'bytes' (default), a tokenizer.json, a .tiktoken file or a .model file")
    pp.add_argument("--workers", type=_int_or_auto, default="auto", help="processes (default: cores)")
    pp.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (default 2^26)")
    pp.add_argument("--text-key", default="text", help="JSONL field / parquet column (default text)")
    pp.add_argument("--txt-mode", choices=["file", "lines", "paragraphs"], default="file",
                    help="one document per .txt file (default), per line, or per paragraph")
    pp.add_argument("--on-error", choices=["raise", "skip"], default="raise",
                    help="stop at the first bad input (default) or skip and count it")
    pp.add_argument("--no-eos", action="store_true", help="do not append EOS to documents")
    pp.add_argument("--bos", action="store_true", help="prepend BOS to every document")
    pp.add_argument("--eos-token", default=None, help="EOS token string, if not detected")
    pp.add_argument("--no-fast-tokenizer", action="store_true",
                    help="never swap a tokenizer.json for its equivalent tiktoken encoding")
    pp.add_argument("--overwrite", action="store_true", help="replace a different store at --out")
    pp.add_argument("--engine", choices=["local", "ray"], default="local",
                    help="local processes (default) or Ray tasks (pip install 'tokenmill[ray]'); "
                    "the same store, byte for byte")
    pp.add_argument("--ray-address", default=None, metavar="auto|HOST:PORT",
                    help="--engine ray: the cluster to join (default: $RAY_ADDRESS, else a "
                    "private Ray instance on this machine with --workers CPUs)")
    pp.add_argument("--quiet", action="store_true", help="no progress output")

    pi = sub.add_parser("inspect", help="describe a store")
    pi.add_argument("store")
    pi.add_argument("--json", action="store_true", help="print JSON instead of text")
    pi.add_argument("--plot", metavar="FILE.png", help="write a histogram of document lengths")

    pv = sub.add_parser("verify", help="check a store's structure and every checksum")
    pv.add_argument("store")

    pm = sub.add_parser("import-megatron", help="make a store of Megatron-LM .bin/.idx datasets "
                        "(the .bin files are hard-linked, not copied)")
    pm.add_argument("prefixes", nargs="+", metavar="PREFIX", help="dataset prefix of PREFIX.bin/.idx")
    pm.add_argument("--out", required=True, help="store directory to create (new or empty)")
    pm.add_argument("--tokenizer", required=True,
                    help="the tokenizer the data was made with: 'bytes', a tokenizer.json, a "
                    ".tiktoken file or a .model file")
    pm.add_argument("--link", choices=["hard", "symlink", "copy"], default="hard",
                    help="hard link (default; a symlink when that fails, e.g. across filesystems), "
                    "symlink, or copy the .bin files")
    pm.add_argument("--quiet", action="store_true", help="no progress output")

    pe = sub.add_parser("export", help="write a store as a nanoGPT train.bin or as JSONL text")
    pe.add_argument("store")
    pe.add_argument("--format", required=True, choices=["nanogpt", "jsonl"],
                    help="nanogpt: flat uint16 token ids; jsonl: one {\"text\": …} per document")
    pe.add_argument("--out", required=True, help="file to write (replaced atomically)")
    pe.add_argument("--tokenizer", default=None,
                    help="jsonl: the store's tokenizer, if not at the path its manifest records")
    pe.add_argument("--quiet", action="store_true", help="no progress output")

    pb = sub.add_parser("bench", help="compare tokenmill with other loaders on a store")
    from tokenmill.bench import add_arguments
    add_arguments(pb)

    pl = sub.add_parser("plan", help="memory the loader's buffers take for a config")
    pl.add_argument("--seq-len", type=int, required=True)
    pl.add_argument("--batch-size", type=int, required=True)
    pl.add_argument("--layout", choices=["concat", "packed"], default="concat")
    pl.add_argument("--dtype", choices=["int32", "int64"], default="int32")
    pl.add_argument("--prefetch", type=int, default=2)
    pl.add_argument("--store", default=None, help="a store, to size the packed layout")

    pd = sub.add_parser("demo", help="the end-to-end demo on built-in data")
    pd.add_argument("--out", default="demo-out", help="working directory (default demo-out)")
    pd.add_argument("--quick", action="store_true", help="a smaller, faster run")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except TokenmillError as e:
        print(f"tokenmill {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tokenmill {args.command}: interrupted", file=sys.stderr)
        return 130


def _prepare(args) -> int:
    from tokenmill.prepare import prepare
    options = dict(text_key=args.text_key, txt_mode=args.txt_mode, on_error=args.on_error,
                   add_eos=not args.no_eos, add_bos=args.bos, eos=args.eos_token,
                   fast_tokenizer=not args.no_fast_tokenizer)
    if args.shard_tokens is not None:
        options["shard_tokens"] = args.shard_tokens
    prepare(args.inputs, out=args.out, tokenizer=args.tokenizer, workers=args.workers,
            progress=False if args.quiet else None, overwrite=args.overwrite,
            engine=args.engine, ray_address=args.ray_address, **options)
    return 0


def _inspect(args) -> int:
    from tokenmill.inspection import describe, format_description, plot_lengths
    info = describe(args.store)
    print(json.dumps(info, indent=1) if args.json else format_description(info))
    if args.plot:
        plot_lengths(args.store, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _verify(args) -> int:
    from tokenmill.store import verify_store
    problems = verify_store(args.store)
    if problems:
        for line in problems:
            print(f"BAD  {line}")
        print(f"{args.store}: {len(problems)} problem(s) found")
        return 1
    print(f"{args.store}: OK (structure and every checksum verified)")
    return 0


def _import_megatron(args) -> int:
    from tokenmill.interchange import import_megatron
    from tokenmill.prepare import summary_line
    manifest = import_megatron(args.prefixes, out=args.out, tokenizer=args.tokenizer,
                               link=args.link, progress=False if args.quiet else None)
    if not args.quiet:
        links = ", ".join(sorted(set(manifest["settings"]["links"])))
        print(f"{summary_line(manifest)}; .bin files: {links}", file=sys.stderr)
    return 0


def _export(args) -> int:
    from tokenmill.interchange import export
    done = export(args.store, out=args.out, format=args.format, tokenizer=args.tokenizer,
                  progress=False if args.quiet else None)
    if not args.quiet:
        print(f"wrote {done['out']}: {done['documents']:,} documents, {done['tokens']:,} tokens, "
              f"{done['bytes']:,} bytes", file=sys.stderr)
    return 0


def _bench(args) -> int:
    from tokenmill.bench import run_from_args
    return run_from_args(args)


def _plan(args) -> int:
    from tokenmill.loader import PREFETCH_MEMORY_BUDGET, memory_plan
    docs = 0
    if args.store:
        from tokenmill.store import read_manifest
        docs = read_manifest(args.store)["num_documents"]
    plan = memory_plan(seq_len=args.seq_len, batch_size=args.batch_size, layout=args.layout,
                       dtype=args.dtype, prefetch=args.prefetch, num_documents=docs)
    print(f"batch ring     {plan['batch_ring'] / 2**20:10.2f} MiB  "
          f"({args.prefetch} prefetched + 2 held batches of {args.batch_size}×{args.seq_len})")
    if args.layout == "packed":
        print(f"packed layout  {plan['packed_layout'] / 2**20:10.2f} MiB  ({docs:,} documents)")
    print(f"total          {plan['total'] / 2**20:10.2f} MiB  (prefetch=\"auto\" grows within "
          f"{PREFETCH_MEMORY_BUDGET / 2**30:.0f} GiB)")
    return 0


def _demo(args) -> int:
    from tokenmill.demo import run_demo
    run_demo(Path(args.out), quick=args.quick)
    return 0


_COMMANDS = {"prepare": _prepare, "inspect": _inspect, "verify": _verify,
             "import-megatron": _import_megatron, "export": _export, "bench": _bench,
             "plan": _plan, "demo": _demo}

"""The stream plan: everything a pass over raw text depends on, fixed when the loader is built.

The inputs are listed and cut into work units exactly as ``prepare`` does; the plan holds those
units, the options that decide the cached store's bytes, the cache's place and key, and the
settings of the order (seq_len, seed, shuffle buffer). Its ``fingerprint`` goes into every state:

    plan = plan_stream(["data/"], PrepareConfig(tokenizer="bytes"), tok, cache_dir="cache/",
                       order=OrderSettings(seq_len=2048, seed=0, shuffle_buffer=4096),
                       num_workers=1)
    plan.store_dir     # cache/stream-<content key>/ : a store once the pass has ended
    plan.fingerprint   # 16 hex digits: inputs, tokenizer, options, seq_len, seed, shuffle_buffer

A ``Cursor`` (unit, doc, token, row) says where reading may restart: document ``doc`` of unit
``unit``, which begins at global token ``token`` of the stream. Cursors in a saved state carry a
check (``cursor_check``) that ties the three numbers to the plan, so an edited one is refused.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
import xxhash

from tokenmill.load import pack
from tokenmill.inputs import sources
from tokenmill.base.errors import ConfigError, check_int
from tokenmill.base.io import filesystem, is_url, xxh3_file
from tokenmill.prepare.identity import changed_inputs, listed
from tokenmill.prepare.run import file_sizes
from tokenmill.prepare.tokenize import PrepareConfig, input_name, tokenizer_of
from tokenmill.base.procs import resolve_workers, usable_cores
from tokenmill.inputs.records import local_path
from tokenmill.load.sampler import MAX_SEED
from tokenmill.load.state import STATE_VERSION
from tokenmill.store.format import MANIFEST
from tokenmill.tokenizer import Tokenizer, token_dtype

DEFAULT_SHUFFLE_BUFFER = 4096  # windows: 8 Mi tokens at seq_len 2048, 16 MiB as uint16
DEFAULT_PACK_WINDOW = 1024  # rows' worth of tokens packed together: 2 Mi tokens at seq_len 2048
STREAM_LAYOUTS = ("concat", "packed")


class Cursor(NamedTuple):
    """Where reading may restart: document ``doc`` of unit ``unit``, at global token ``token``;
    for packed rows also ``row``, the pass's first row packed from there (0 for concat)."""

    unit: int
    doc: int
    token: int
    row: int = 0


START = Cursor(0, 0, 0)


@dataclass(frozen=True)
class OrderSettings:
    """What decides the order of the pass's windows (checked on construction)."""

    seq_len: int
    seed: int = 0
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER
    layout: str = "concat"
    max_segments: int | None = None  # packed: at most this many documents a row
    pack_window: int = DEFAULT_PACK_WINDOW  # packed: rows' worth of tokens packed together

    def __post_init__(self):  # frozen: the ints are made plain ints once, here
        for name in ("seq_len", "shuffle_buffer", "pack_window"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=1))
        if self.layout not in STREAM_LAYOUTS:
            raise ConfigError(f"layout must be one of {STREAM_LAYOUTS} "
                              f"(got layout={self.layout!r})")
        object.__setattr__(self, "max_segments", check_int(
            "max_segments", self.max_segments, minimum=1, optional=True))
        if self.max_segments is not None and self.layout != "packed":
            raise ConfigError(f"max_segments needs layout='packed' (got max_segments="
                              f"{self.max_segments!r}, layout={self.layout!r})")
        object.__setattr__(self, "seed", check_int("seed", self.seed, minimum=0,
                                                   maximum=MAX_SEED))


@dataclass(frozen=True)
class StreamPlan:
    """Everything a pass depends on: the units to read, how, where the cache goes, the order."""

    config: PrepareConfig
    storage_options: Mapping | None
    units: tuple[sources.Unit, ...]
    list_skips: tuple[sources.Skip, ...]
    settings: dict  # what the cached store's manifest records (prepare's settings)
    key: str  # the cache's resume key: its content key and unit_bytes (cursors count units)
    store_dir: Path
    lock_path: Path
    dtype: np.dtype
    order_settings: OrderSettings
    num_workers: int
    fingerprint: str

    @property
    def seq_len(self) -> int:
        """L: tokens per sample."""
        return int(self.order_settings.seq_len)

    @property
    def seed(self) -> int:
        """The seed of the order and of the store's later epochs."""
        return int(self.order_settings.seed)

    @property
    def shuffle_buffer(self) -> int:
        """S: windows held by the shuffle buffer."""
        return int(self.order_settings.shuffle_buffer)

    @property
    def packed(self) -> bool:
        """True for packed rows (document-aware), False for concat windows."""
        return self.order_settings.layout == "packed"

    @property
    def window_tokens(self) -> int:
        """Packed: the packing window W = pack_window · (seq_len + 1) tokens (docs/streaming.md)."""
        return int(self.order_settings.pack_window) * (self.seq_len + 1)

    @property
    def offset(self) -> int:
        """Where epoch 0's windows start (the store Loader's epoch-0 offset)."""
        return pack.concat_offset(self.seq_len, seed=self.seed, epoch=0)

    @property
    def order(self) -> dict[str, int]:
        """The keyword arguments of ``order``'s functions: seed and shuffle_buffer."""
        return {"seed": self.seed, "shuffle_buffer": self.shuffle_buffer}

    def window_start(self, window: int) -> int:
        """The global token where concat window ``window`` of the pass begins."""
        return self.offset + window * self.seq_len


def plan_stream(inputs: str | os.PathLike | Sequence, config: PrepareConfig, tokenizer: Tokenizer,
                *, cache_dir: str | os.PathLike, order: OrderSettings, num_workers: int,
                storage_options: Mapping | None = None) -> StreamPlan:
    """List and cut the inputs, key the cache by their content and the options: the plan."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    inputs = [os.fspath(i) for i in inputs]
    files, list_skips = sources.list_files(inputs, on_error=config.on_error,
                                           storage_options=storage_options, split=config.split,
                                           text_ext=config.text_ext)
    sizes = file_sizes(files, storage_options)  # as prepare records them: the same settings
    mtimes = modification_times(files, storage_options)
    settings = config.settings(inputs, files, sizes, storage_options)
    # the store's bytes depend on these; the cursors in progress files and states on units too
    content = digest({"settings": settings, "mtimes": mtimes,
                      "tokenizer": tokenizer.identity()})[:16]
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    units = sources.plan_units(files, config.source_config(storage_options))
    content = fresh_content(content, cache_dir, units, storage_options)
    key = digest({"content": content, "unit_bytes": config.unit_bytes})
    fingerprint = digest({"stream": STATE_VERSION, "key": key, **layout_record(order)})[:16]
    return StreamPlan(config=config, storage_options=storage_options, units=tuple(units),
                      list_skips=tuple(list_skips), settings=settings, key=key,
                      store_dir=cache_dir / f"stream-{content}",
                      lock_path=cache_dir / f"stream-{content}.lock",
                      dtype=token_dtype(tokenizer.vocab_size), order_settings=order,
                      num_workers=num_workers, fingerprint=fingerprint)


def fresh_content(content: str, cache_dir: Path, units: Sequence[sources.Unit],
                  storage_options) -> str:
    """The cache's content key: ``content``, or, when the finished cache under it was made from
    another version of an input (rewritten under the same size and modification time: prepare's
    check, ``prepare.identity``), a key that also hashes those inputs' bytes now, so the pass is
    streamed again into a new cache."""
    try:
        manifest = json.loads((cache_dir / f"stream-{content}" / MANIFEST).read_text())
    except (OSError, ValueError):
        return content  # no finished cache to reuse
    files = list(dict.fromkeys(unit.path for unit in units))  # as the cache records them
    changed = changed_inputs(manifest, files, storage_options)
    if not changed:
        return content
    fresh = digest({"content": content, "bytes": [
        [input_name(f), xxh3_file(local_path(f) or f, storage_options=storage_options)]
        for f in changed]})[:16]
    warnings.warn(f"tokenmill: {listed([f'{f} ({how})' for f, how in changed.items()])} changed "
                  f"since the cache {cache_dir / f'stream-{content}'} was written; streaming "
                  f"it again into {cache_dir / f'stream-{fresh}'}", stacklevel=3)
    return fresh


def layout_record(order: OrderSettings) -> dict:
    """What the order and layout add to a stream's fingerprint (concat: as before packing)."""
    record = {"seq_len": int(order.seq_len), "seed": int(order.seed),
              "shuffle_buffer": int(order.shuffle_buffer)}
    if order.layout == "packed":
        m = order.max_segments
        record.update(layout="packed", pack_window=int(order.pack_window),
                      max_segments=None if m is None else int(m))
    return record


def modification_times(files: Sequence[str], storage_options) -> list:
    """Each file's modification time (for URLs what the store reports; 0 when unreadable)."""
    mtimes: list = []
    for f in files:
        try:
            if is_url(f):
                fs, p = filesystem(f, storage_options)
                info = fs.info(p)
                mtimes.append(str(info.get("mtime") or info.get("LastModified") or ""))
            else:
                mtimes.append(os.stat(f).st_mtime_ns)
        except OSError:
            mtimes.append(0)
    return mtimes


def load_stream_tokenizer(config: PrepareConfig) -> Tokenizer:
    """The tokenizer ``config`` names, with its EOS/BOS choices; checks add_bos has a BOS."""
    tok = tokenizer_of(config)
    if config.add_bos and tok.bos_id is None:
        raise ConfigError(f"add_bos=True but tokenizer {config.tokenizer!r} has no BOS token; "
                          "pass bos='…'")
    return tok


def resolve_stream_workers(num_workers: int | str) -> int:
    """Tokenizing processes: "auto" leaves a core to the training step and shares the rest
    among the ranks of this machine (LOCAL_WORLD_SIZE); 0 tokenizes in the loader's thread."""
    if num_workers == "auto":
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        return max(1, (usable_cores() - 1) // local)
    return resolve_workers(num_workers, name="num_workers", minimum=0)


def cursor_check(fingerprint: str, cursor: Cursor) -> str:
    """The check a saved cursor carries: ties (unit, doc, token[, row]) to the plan's fingerprint
    (a concat cursor's row is 0 and left out, so earlier checks stay valid)."""
    values = [int(x) for x in (cursor if cursor.row else cursor[:3])]
    return digest({"fingerprint": fingerprint, "cursor": values})[:16]


def digest(obj: Any) -> str:
    """xxh3-128 hex of ``obj`` as canonical JSON."""
    return xxhash.xxh3_128_hexdigest(json.dumps(obj, sort_keys=True).encode())

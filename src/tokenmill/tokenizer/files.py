r"""Which tokenizer file a spec means: a path, a folder, a tiktoken encoding name or a Hub id.

    spec                               found                                        read as
    "path/to/file" (any name)          that file, kind by its content (then name)   hf | sentencepiece | tiktoken
    "path/to/folder"                   the folder's tokenizer (below)               …
    "cl100k_base", "gpt2", "o200k_base" tiktoken's own cache (never downloaded)    tiktoken
    "org/name", "org/name@revision"    huggingface_hub's cache, then the Hub        the snapshot's tokenizer

resolve("bytes") is not handled here (tokenmill.tokenizer knows it). A folder or snapshot yields
tokenizer.json, else a SentencePiece model (tokenizer.model, tokenizer.model.v3, …), else
tiktoken ranks, recognised by their content. Beside a tokenizer.json, tokenizer_config.json
(``eos_token``) and generation_config.json (``eos_token_id``) name the EOS/BOS when the
tokenizer.json alone does not.

"gpt2" is tiktoken's gpt2 encoding (vocab.bpe + encoder.json in tiktoken's cache): the same BPE
and ids as the Hub's openai-community/gpt2 tokenizer.json, EOS <|endoftext|> = 50256. The Hub's
file is ``--tokenizer openai-community/gpt2``.

tiktoken caches a blob under ``sha1(url)`` in $TIKTOKEN_CACHE_DIR, else $DATA_GYM_CACHE_DIR, else
<tmp>/data-gym-cache, and checks its sha256 (tiktoken/load.py, read_file_cached): so do we, and a
missing or mismatched blob is an error saying how to fetch it, never a download.

A Hub id is looked up in the local cache first ($HF_HUB_CACHE, else $HF_HOME/hub, else
huggingface_hub's default) and downloaded (tokenizer files only) only when absent and
$HF_HUB_OFFLINE is unset: every worker process then reads the very files the parent chose.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import tempfile
import types
from dataclasses import dataclass

from tokenmill.base.errors import TokenizerError

__all__ = ["TokenizerFile", "openai_params", "parse_ranks", "resolve", "sniff", "tiktoken_cache_dir"]

KIND_BY_EXTENSION = {".json": "hf", ".tiktoken": "tiktoken", ".model": "sentencepiece"}
SPEC_FORMS = ("'bytes', a Hugging Face tokenizer.json (any .json), a tiktoken BPE file (.tiktoken), "
              "a sentencepiece model (.model), a folder holding one, a tiktoken encoding name "
              "(gpt2, r50k_base, p50k_base, cl100k_base, o200k_base) or a Hugging Face Hub id "
              "(org/name[@revision])")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(?:@\S+)?")
HUB_PATTERNS = ["tokenizer*", "*.model", "*.model.v*", "*.tiktoken", "generation_config.json",
                "special_tokens_map.json"]
NOT_TOKENIZERS = {"tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                  "config.json", "added_tokens.json", "vocab.json", "preprocessor_config.json",
                  "chat_template.json"}
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")
KIND_ORDER = ("hf", "sentencepiece", "tiktoken")  # a folder's preference
TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} \d+\r?")


@dataclass(frozen=True)
class TokenizerFile:
    """A tokenizer found for a spec: its kind, the file(s) read, their bytes, and where from."""

    kind: str  # "hf" | "tiktoken" | "sentencepiece"
    path: str  # the file read (messages name it)
    data: bytes  # its content: the fingerprint hashes these bytes
    asked: str | None = None  # the name asked for; None when the spec was the file's path
    encoding: str | None = None  # tiktoken: the OpenAI encoding whose regex and specials apply
    ranks: dict | None = None  # tiktoken: the mergeable ranks, when read from tiktoken's cache
    eos: str | int | None = None  # the EOS named by tokenizer_config / generation_config.json
    bos: str | int | None = None
    eos_from: str | None = None  # which file named it
    source: str | None = None  # where it came from, machine-independent (for the manifest)


def resolve(spec: str) -> TokenizerFile:
    """The tokenizer file ``spec`` means: a file, a folder, a tiktoken name or a Hub id.

    resolve("tokenizer.json").kind == "hf"
    """
    if os.path.isfile(spec):
        return file_at(spec)
    if os.path.isdir(spec):
        return in_folder(spec, spec)
    from tiktoken_ext.openai_public import ENCODING_CONSTRUCTORS

    if spec in ENCODING_CONSTRUCTORS:
        return from_tiktoken_cache(spec)
    is_file_name = os.path.splitext(spec)[1].lower() in KIND_BY_EXTENSION
    if HUB_ID.fullmatch(spec) and not is_file_name:
        return from_hub(spec)
    if is_file_name or os.sep in spec or spec.startswith("."):
        raise TokenizerError(f"tokenizer file not found: {spec!r} (expected {SPEC_FORMS})")
    raise TokenizerError(
        f"unknown tokenizer spec {spec!r}: not a file or folder here, not a tiktoken encoding "
        f"name ({', '.join(sorted(ENCODING_CONSTRUCTORS))}) and not a Hub id (org/name); "
        f"expected {SPEC_FORMS}")


def sniff(head: bytes) -> str | None:
    """The kind a file's first bytes show: "hf" (a JSON object), "sentencepiece" (a protobuf
    ModelProto: field 1, a piece, whose own field 1 is its text), "tiktoken" (base64, space, rank).

    sniff(b"IQ== 0\\nIg== 1\\n") == "tiktoken"
    """
    if head.lstrip()[:1] == b"{":
        return "hf"
    if head[:1] == b"\x0a":
        i = 1
        while i < min(len(head), 6) and head[i] & 0x80:  # the piece's varint length
            i += 1
        if i + 1 < len(head) and head[i + 1] == 0x0A:
            return "sentencepiece"
    lines = head.split(b"\n")[:-1] or [head]  # whole lines only (the last may be cut)
    if all(TIKTOKEN_LINE.fullmatch(line) for line in lines[:8]):
        return "tiktoken"
    return None


def file_at(path: str, *, asked: str | None = None, source: str | None = None) -> TokenizerFile:
    """The tokenizer file at ``path``, its kind read from its content (else its extension)."""
    with open(path, "rb") as f:
        head = f.read(256)
        kind = sniff(head) or KIND_BY_EXTENSION.get(os.path.splitext(path)[1].lower())
        if kind is None:  # say so before reading what may be a large data file
            raise TokenizerError(f"{path}: not a tokenizer file (its content is not a "
                                 "tokenizer.json, a sentencepiece model or tiktoken ranks); "
                                 f"expected {SPEC_FORMS}")
        data = head + f.read()
    hints: dict = {}
    if kind == "hf":
        hints = special_hints(os.path.dirname(path))
    return TokenizerFile(kind, path, data, asked=asked, source=source, **hints)


def special_hints(folder: str) -> dict:
    """EOS/BOS named by tokenizer_config.json (eos_token: text or {"content": text}), else by
    generation_config.json (eos_token_id: an id or a list, the first counts), in ``folder``."""
    found: dict = {}
    for name, suffix in (("tokenizer_config.json", "_token"), ("generation_config.json", "_token_id")):
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            continue
        for what in ("eos", "bos"):
            value = config.get(what + suffix) if isinstance(config, dict) else None
            value = value.get("content") if isinstance(value, dict) else value
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, (str, int)) and not isinstance(value, bool) and what not in found:
                found[what] = value
                if what == "eos":
                    found["eos_from"] = name
    return found


def in_folder(folder: str, asked: str | None, source: str | None = None) -> TokenizerFile:
    """The tokenizer in a folder: tokenizer.json, else a sentencepiece model, else tiktoken
    ranks, recognised by content whatever their names."""
    path = pick(folder)
    if path is None:
        raise TokenizerError(f"{folder}: holds no tokenizer file (looked for tokenizer.json, a "
                             "sentencepiece model such as tokenizer.model or tokenizer.model.v3, "
                             "and tiktoken ranks); pass the tokenizer file itself")
    where = f"{source}/{os.path.basename(path)}" if source else None
    return file_at(path, asked=asked if asked != folder else None, source=where)


def pick(folder: str) -> str | None:
    """The path of the tokenizer file in ``folder`` (top level only), or None."""
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return os.path.join(folder, "tokenizer.json")
    found: dict[str, str] = {}
    names = sorted(os.listdir(folder), key=lambda n: (not n.startswith("tokenizer"), n))
    for name in names:
        path = os.path.join(folder, name)
        if name in NOT_TOKENIZERS or name.endswith(WEIGHTS) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            kind = sniff(f.read(256))
        if kind == "hf" and not has_model(path):
            continue
        if kind is not None:
            found.setdefault(kind, path)
    return next((found[k] for k in KIND_ORDER if k in found), None)


def has_model(path: str) -> bool:
    """True if the JSON file at ``path`` (under 256 MB) is an object with a "model" object."""
    if os.path.getsize(path) > 256 << 20:
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return isinstance(json.load(f).get("model"), dict)
    except (OSError, ValueError, AttributeError):
        return False


# ---- tiktoken's cache ------------------------------------------------------------------------

def tiktoken_cache_dir() -> str:
    """Where tiktoken caches blobs, as tiktoken.load.read_file_cached decides ("" disables it)."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return os.environ[var]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def parse_ranks(data: bytes, path: str = "") -> dict[bytes, int]:
    """tiktoken ranks: one "base64-token rank" per line (tiktoken.load.load_tiktoken_bpe's format).

    parse_ranks(b"IQ== 0\\nIg== 1\\n") == {b"!": 0, b'"': 1}
    """
    try:
        return {base64.b64decode(token, validate=True): int(rank)
                for token, rank in (line.split() for line in data.splitlines() if line)}
    except ValueError as e:  # binascii.Error is a ValueError
        raise TokenizerError(f"{path}: not a tiktoken BPE file "
                             f"(base64 token, space, rank per line): {e}") from None


def from_tiktoken_cache(name: str) -> TokenizerFile:
    """OpenAI's encoding ``name`` from the blobs tiktoken has cached (tiktoken_ext.openai_public
    says which URLs and sha256s); a TokenizerError saying how to fetch them if absent."""
    read: list[tuple[str, bytes]] = []
    params = run_constructor(name, lambda url, expected_hash=None:
                             read_cached(name, url, expected_hash, read), read)
    paths = [p for p, _ in read]
    return TokenizerFile("tiktoken", paths[0], b"".join(d for _, d in read), asked=name,
                         encoding=name, ranks=params["mergeable_ranks"],
                         source=f"tiktoken:{name} ({', '.join(os.path.basename(p) for p in paths)})")


def read_cached(name: str, url: str, expected_hash: str | None,
                read: list[tuple[str, bytes]]) -> bytes:
    """The bytes tiktoken cached for ``url``; appended to ``read`` with their path."""
    import tiktoken.load

    cache = tiktoken_cache_dir()
    fetch = (f"run once online: python -c \"import tiktoken; tiktoken.get_encoding('{name}')\" "
             "(or copy the file there and set TIKTOKEN_CACHE_DIR to its folder); tokenmill never "
             "downloads it")
    if cache == "":
        raise TokenizerError(f"tiktoken encoding {name!r}: TIKTOKEN_CACHE_DIR is empty, which "
                             f"turns tiktoken's cache off; set it to a folder and {fetch}")
    path = os.path.join(cache, hashlib.sha1(url.encode()).hexdigest())
    if not os.path.isfile(path):
        raise TokenizerError(f"tiktoken encoding {name!r} is not in tiktoken's cache: no {path} "
                             f"(the sha1 of {url}); {fetch}")
    with open(path, "rb") as f:
        data = f.read()
    if expected_hash and not tiktoken.load.check_hash(data, expected_hash):
        raise TokenizerError(f"tiktoken encoding {name!r}: {path} is not the file tiktoken expects "
                             f"for {url} (sha256 differs from {expected_hash}); delete it and "
                             f"{fetch}")
    read.append((path, data))
    return data


def run_constructor(name: str, read, read_log: list) -> dict:
    """tiktoken_ext.openai_public's constructor for ``name``, its files read by ``read(url,
    expected_hash)`` (copies of the functions run, so tiktoken's modules stay untouched)."""
    import tiktoken.load

    gym = tiktoken.load.data_gym_to_mergeable_bpe_ranks
    gym_env = {**vars(tiktoken.load), "read_file_cached": read}
    loaders = {"load_tiktoken_bpe": lambda url, expected_hash=None:
               parse_ranks(read(url, expected_hash), url),
               "data_gym_to_mergeable_bpe_ranks": types.FunctionType(
                   gym.__code__, gym_env, gym.__name__, gym.__defaults__, gym.__closure__)}
    try:
        return copied_constructor(name, loaders)
    except (AssertionError, KeyError, ValueError) as e:  # data_gym's own consistency checks
        where = ", ".join(p for p, _ in read_log)
        raise TokenizerError(f"tiktoken encoding {name!r}: {where} is not a valid {name} "
                             f"file ({type(e).__name__}: {e})") from None


def openai_params(name: str, ranks: dict[bytes, int]) -> dict | None:
    """OpenAI's constructor for ``name`` (pattern, special tokens) run on local ranks; None if
    ``name`` is not one. The cl100k/o200k regexes live only inside those constructors, so rather
    than copying them we run copies whose file loaders return ``ranks``: nothing is read."""
    from tiktoken_ext import openai_public

    if name not in openai_public.ENCODING_CONSTRUCTORS:
        return None
    same = lambda *a, **k: ranks  # noqa: E731
    return copied_constructor(name, {"load_tiktoken_bpe": same,
                                     "data_gym_to_mergeable_bpe_ranks": same})


def copied_constructor(name: str, loaders: dict) -> dict:
    """Run a copy of openai_public's constructor for ``name`` with ``loaders`` as its globals."""
    from tiktoken_ext import openai_public

    ctors = openai_public.ENCODING_CONSTRUCTORS
    env = {**vars(openai_public), **loaders}
    for fn in ctors.values():  # o200k_harmony calls o200k_base(): copy them all
        env[fn.__name__] = types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__,
                                              fn.__closure__)
    return env[ctors[name].__name__]()


# ---- the Hugging Face Hub --------------------------------------------------------------------

def hub_cache_dir() -> str:
    """huggingface_hub's cache folder as the environment says now: $HF_HUB_CACHE, else
    $HF_HOME/hub, else the library's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def hub_offline() -> bool:
    """True if $HF_HUB_OFFLINE (or $TRANSFORMERS_OFFLINE) says so, as huggingface_hub reads it."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return constants.HF_HUB_OFFLINE or (value or "").upper() in {"1", "ON", "YES", "TRUE"}


def from_hub(spec: str) -> TokenizerFile:
    """The tokenizer of Hub model ``org/name[@revision]``: from the cache, else downloaded
    (tokenizer files only) unless offline; the Hub's own message when it refuses (gated, …)."""
    try:
        from huggingface_hub import errors, snapshot_download
    except ImportError:
        raise TokenizerError(f"tokenizer {spec!r} looks like a Hugging Face Hub id, which needs "
                             "huggingface_hub: pip install 'tokenmill[hf]' (or huggingface_hub)"
                             ) from None
    repo, _, revision = spec.partition("@")
    cache, offline = hub_cache_dir(), hub_offline()
    kwargs = dict(revision=revision or None, cache_dir=cache, allow_patterns=HUB_PATTERNS)
    try:
        folder = snapshot_download(repo, local_files_only=True, **kwargs)
    except errors.IncompleteSnapshotError as e:
        folder, missing = None, str(e).split(". ")[0]
    except (errors.LocalEntryNotFoundError, ValueError):
        folder, missing = None, f"no snapshot of revision {revision or 'main'} there"
    if folder is not None and pick(folder) is None and not offline:
        folder, missing = None, "the cached snapshot holds no tokenizer file"
    if folder is None and offline:
        raise TokenizerError(
            f"tokenizer {spec!r}: no such file or folder here, and not found in the Hugging "
            f"Face cache {cache} ({missing}); "
            f"HF_HUB_OFFLINE is set: unset it to download it, or fetch it where there is "
            f"network (hf download {repo}{' --revision ' + revision if revision else ''} --include 'tokenizer*' '*.model*' '*_config.json') "
            "and point HF_HOME or HF_HUB_CACHE at that cache")
    if folder is None:
        try:
            folder = snapshot_download(repo, **kwargs)
        except errors.HfHubHTTPError as e:  # gated, no such repo or revision: the Hub's words
            raise TokenizerError(f"tokenizer {spec!r}: the Hub says: {e}") from None
        except (errors.LocalEntryNotFoundError, OSError) as e:  # no network, Hub down
            raise TokenizerError(f"tokenizer {spec!r}: not in the Hugging Face cache {cache} "
                                 f"and not downloadable: {e}") from None
    commit = os.path.basename(os.path.normpath(folder))
    return in_folder(folder, spec, source=f"hf:{repo}@{commit}")

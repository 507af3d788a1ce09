r"""Tokenizers behind one small protocol, chosen by a spec string.

    spec                          kind             engine (tok.engine)
    "bytes" (the default)         "bytes"          UTF-8 bytes 0..255, EOS 256, BOS 257
    ".../tokenizer.json", *.json  "hf"             "fastokens", "tiktoken" or "tokenizers"
    ".../name.tiktoken"           "tiktoken"       tiktoken, from the local file only
    ".../name.model"              "sentencepiece"  sentencepiece
    "cl100k_base", "gpt2", …      "tiktoken"       tiktoken, from tiktoken's cache (no download)
    "org/name[@rev]", a folder    what it holds    as above (huggingface_hub's cache first)

A file's kind is read from its content, so tokenizer.model.v3 or a renamed tokenizer.json load;
tokenmill.tokenizer.files finds the file a name means (and says how "gpt2" is read).

load_tokenizer("bytes").encode_batch(["hi"])[0].tolist() == [104, 105]

encode_batch never adds special tokens; encode_documents appends EOS (and prepends BOS if asked).
Text that contains special-token strings never raises: tiktoken files and sentencepiece encode it
as plain text; Hugging Face tokenizers split it into the added token, as `tokenizers` itself does.
Lone surrogates are replaced by U+FFFD before encoding (in every engine, so they agree).

A tokenizer.json runs on the fastest engine proven at load time to give the ids `tokenizers`
gives (tokenmill.tokenizer.fastbpe: fastokens, then tiktoken, then `tokenizers` itself, warning once when
it falls that far); ``engine=`` picks one by name ("hf": `tokenizers`). ``tok.engine`` says which
runs and ``tok.engine_notes`` why faster ones were refused. The engine never changes the ids, so
``identity()`` (what stores are fingerprinted by) leaves it out. Other files have one engine.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
import xxhash

from tokenmill.base.errors import ConfigError, TokenizerError, require
from tokenmill.base.io import atomic_write_bytes
from tokenmill.tokenizer.fastbpe import ENGINE_CHOICES, NoFastPath, choose_engine, encode_np, scrub
from tokenmill.tokenizer.files import TokenizerFile, openai_params, parse_ranks, resolve

__all__ = ["Tokenizer", "encode_documents", "load_tokenizer", "token_dtype", "train_bpe"]

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
ENDOFTEXT = "<|endoftext|>"
_WARNED: set[str] = set()


class Tokenizer(Protocol):
    """What tokenmill needs of a tokenizer: ids per text, EOS/BOS ids and a stable identity."""

    kind: str  # "hf" | "tiktoken" | "sentencepiece" | "bytes"
    engine: str  # what runs it: "fastokens" | "tiktoken" | "tokenizers" | "sentencepiece" | "bytes"
    engine_notes: tuple[str, ...]  # why faster engines were refused (or "asked for: …")
    source: str | None  # where a name was found ("hf:org/name@commit/tokenizer.json"); None: a path
    vocab_size: int  # max id + 1, special tokens included
    eos_id: int | None
    bos_id: int | None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...

    def identity(self) -> dict: ...


def token_dtype(vocab_size: int) -> np.dtype:
    """The store's token dtype, Megatron's rule: token_dtype(50257) == np.dtype(np.uint16)."""
    if vocab_size < 1:
        raise ConfigError(f"vocab_size must be >= 1 (got {vocab_size=})")
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def load_tokenizer(spec: str | os.PathLike = "bytes", *, engine: str = "auto",
                   eos: str | None = None, bos: str | None = None,
                   fast: bool | str | None = None) -> Tokenizer:
    """The tokenizer a spec names: a file, a folder, a tiktoken name ("cl100k_base") or a Hub id
    ("org/name[@rev]"), found by tokenmill.tokenizer.files. engine= picks what runs a
    tokenizer.json ("auto": the fastest proven identical; "fastokens", "tiktoken" or "hf" for that
    one or an error); eos=/bos= pick those tokens by their text. fast= is the older spelling:
    False is engine "hf", a str an engine.

    load_tokenizer("bytes").vocab_size == 258
    """
    spec = os.fspath(spec)
    engine = fast if isinstance(fast, str) else ("hf" if fast is False else engine)
    if engine not in ENGINE_CHOICES + ("tokenizers",):
        raise ConfigError(f"tokenizer engine must be one of {', '.join(ENGINE_CHOICES)} "
                          f"(got {engine!r})")
    if spec == "bytes":
        if eos is not None or bos is not None:
            raise TokenizerError("the 'bytes' tokenizer has fixed ids EOS=256 and BOS=257; "
                                 f"drop eos=/bos= (got {eos=}, {bos=})")
        one_engine(spec, "bytes", engine)
        return ByteTokenizer()
    found = resolve(spec)
    if found.kind == "hf":
        return HFTokenizer(found, engine=engine, eos=eos, bos=bos, spec=spec)
    cls = TiktokenTokenizer if found.kind == "tiktoken" else SentencePieceTokenizer
    one_engine(spec, cls.engine, engine)
    return cls(found, eos=eos, bos=bos, spec=spec)


def one_engine(spec: str, own: str, engine: str) -> None:
    """Check engine= for a tokenizer with one engine: "auto", "hf" (no substitute) or its own."""
    if engine not in ("auto", "hf", "tokenizers", own):
        raise TokenizerError(f"{spec!r} runs on {own} only (engine= chooses among engines for a "
                             f"tokenizer.json); drop engine={engine!r} or use 'auto'")


def encode_documents(tok: Tokenizer, texts: Sequence[str], *, add_eos: bool = True,
                     add_bos: bool = False, dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """All documents' ids back to back ([BOS] ids [EOS] each) and their int64 lengths.

    encode_documents(load_tokenizer("bytes"), ["hi", ""])[0].tolist() == [104, 105, 256, 256]
    """
    dtype = token_dtype(tok.vocab_size) if dtype is None else np.dtype(dtype)
    if dtype.kind not in "iu" or np.iinfo(dtype).max < tok.vocab_size - 1:
        raise ConfigError(f"dtype {dtype} cannot hold ids up to {tok.vocab_size - 1}; "
                          f"use token_dtype({tok.vocab_size}) = {token_dtype(tok.vocab_size)}")
    for wanted, token_id, name in ((add_eos, tok.eos_id, "eos"), (add_bos, tok.bos_id, "bos")):
        if wanted and token_id is None:
            raise TokenizerError(f"{tok.identity()['name']} has no {name.upper()} token; pass "
                                 f"{name}='…' to load_tokenizer or add_{name}=False")
    docs = tok.encode_batch(texts)
    extra = int(add_eos) + int(add_bos)
    lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs)) + extra
    if not extra:
        flat = np.concatenate(docs, dtype=dtype, casting="unsafe") if docs else np.empty(0, dtype)
        return flat, lengths
    ends = np.cumsum(lengths)
    flat = np.empty(int(ends[-1]) if len(ends) else 0, dtype)
    if add_eos:
        flat[ends - 1] = tok.eos_id
    if add_bos:
        flat[ends - lengths] = tok.bos_id
    for start, doc in zip((ends - lengths + int(add_bos)).tolist(), docs):
        flat[start:start + len(doc)] = doc  # ids < vocab_size, so the cast is exact
    return flat, lengths


def train_bpe(texts: Iterable[str], vocab_size: int, *, out_path: str | os.PathLike) -> str:
    """Train a GPT-2-style byte-level BPE with <|endoftext|>, save it as tokenizer.json; its path.

    load_tokenizer(train_bpe(texts, 32000, out_path="tokenizer.json")).kind == "hf"
    """
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ConfigError(f"vocab_size must be >= 257: 256 bytes + {ENDOFTEXT} (got {vocab_size=})")
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[ENDOFTEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    out_path = os.fspath(out_path)
    atomic_write_bytes(out_path, tok.to_str(pretty=True).encode())  # the bytes tok.save writes
    return out_path


def _identity(kind: str, name: str, vocab_size: int, eos_id, bos_id, data: bytes | None,
              asked: str | None = None, eos_from: str | None = None) -> dict:
    """What a store records of its tokenizer; the name asked for (``spec``) and the file that
    named the EOS (``eos_from``) only when there are such, so a file's identity stays as it was."""
    out = {"kind": kind, "name": name, "vocab_size": vocab_size, "eos_id": eos_id,
           "bos_id": bos_id, "file_xxh3": None if data is None else xxhash.xxh3_64(data).hexdigest()}
    out.update({k: v for k, v in (("spec", asked), ("eos_from", eos_from)) if v is not None})
    return out


def _reload(spec: str, kwargs: dict, notes: tuple[str, ...] | None = None) -> Tokenizer:
    tok = load_tokenizer(spec, **kwargs)
    if notes is not None:
        tok.engine_notes = notes  # why the first load chose this engine, not "asked for"
    return tok


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, EOS 256, BOS 257."""

    kind = engine = "bytes"
    engine_notes = ()
    source = None
    vocab_size, eos_id, bos_id = 258, 256, 257
    _special = {256: ENDOFTEXT, 257: "<|startoftext|>"}  # how decode shows them

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(self._utf8(t), np.uint8) for t in texts]

    @staticmethod
    def _utf8(text: str) -> bytes:
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:
            return scrub(text).encode("utf-8")
        except AttributeError:
            raise TokenizerError(f"texts must be str (got {type(text).__name__})") from None

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise TokenizerError(f"byte ids must be in 0..257 (got {ids.min()}..{ids.max()})")
        parts, start = [], 0
        for i in np.flatnonzero(ids >= 256).tolist() + [len(ids)]:
            parts.append(ids[start:i].astype(np.uint8).tobytes().decode("utf-8", "replace"))
            parts.append(self._special.get(int(ids[i]), "") if i < len(ids) else "")
            start = i + 1
        return "".join(parts)

    def identity(self) -> dict:
        return _identity("bytes", "bytes", 258, 256, 257, None)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class TiktokenTokenizer:
    """A tiktoken Encoding: OpenAI's by name (from tiktoken's cache) or a local ranks file.

    A file named like an OpenAI encoding (r50k_base, p50k_base, cl100k_base, o200k_base, ...)
    gets that encoding's regex and special tokens; any other file gets the cl100k_base regex and
    one special token, <|endoftext|>, with the id after the last rank.
    """

    kind = engine = "tiktoken"
    engine_notes = ()

    def __init__(self, found: TokenizerFile, *, eos: str | None, bos: str | None, spec: str):
        import tiktoken

        path, self._asked = found.path, found.asked  # not found itself: its ranks can be large
        self._spec, self._kwargs, self.source = spec, {"eos": eos, "bos": bos}, found.source
        self._data = found.data
        self.name = found.encoding or os.path.basename(path)
        stem = found.encoding or self.name.removesuffix(".tiktoken")
        ranks = found.ranks if found.ranks is not None else parse_ranks(found.data, path)
        if not ranks:
            raise TokenizerError(f"{path}: holds no tokens")
        params = openai_params(stem, ranks)
        if params is None:
            pat_str = openai_params("cl100k_base", ranks)["pat_str"]
            specials = {ENDOFTEXT: max(ranks.values()) + 1}
        else:
            pat_str, specials = params["pat_str"], params["special_tokens"]
            want = params.get("explicit_n_vocab") or len(ranks) + len(specials)
            if len(ranks) + len(specials) != want or max(ranks.values()) >= min(specials.values()):
                raise TokenizerError(f"{path}: named like OpenAI's {stem} but does not fit its "
                                     f"special tokens {specials}; rename the file to get the "
                                     "default (cl100k regex, <|endoftext|> after the last rank)")
        try:
            self._enc = tiktoken.Encoding(f"tokenmill-{stem}", pat_str=pat_str,
                                          mergeable_ranks=ranks, special_tokens=specials)
        except BaseException as e:  # the Rust core panics on inconsistent ranks
            raise TokenizerError(f"{path}: tiktoken cannot build an encoding from it: {e}") from e
        self.vocab_size = self._enc.n_vocab
        self.eos_id = self._special_id(specials, eos, "eos", ENDOFTEXT, required=True)
        self.bos_id = self._special_id(specials, bos, "bos", "<|startoftext|>", required=False)

    def _special_id(self, specials: dict, text: str | None, what: str, default: str,
                    *, required: bool) -> int | None:
        if text is not None and text not in specials:
            raise TokenizerError(f"{self._spec}: {what}={text!r} is not one of its special tokens "
                                 f"{sorted(specials)}")
        token_id = specials.get(default if text is None else text)
        if token_id is None and required:
            raise TokenizerError(f"{self._spec} has no {default} token; pass {what}='…' "
                                 f"(one of {sorted(specials)})")
        return token_id

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [encode_np(self._enc, t, frozenset()) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._enc.decode(np.asarray(ids).tolist(), errors="replace")

    def identity(self) -> dict:
        return _identity("tiktoken", self.name, self.vocab_size, self.eos_id, self.bos_id,
                         self._data, self._asked)

    def __reduce__(self):
        return _reload, (self._spec, self._kwargs)

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self._spec!r})"


class SentencePieceTokenizer:
    """A sentencepiece model file; EOS is the model's own unless eos= names a piece."""

    kind = engine = "sentencepiece"
    engine_notes = ()

    def __init__(self, found: TokenizerFile, *, eos: str | None, bos: str | None, spec: str):
        spm = require("sentencepiece", "sentencepiece", f"{spec}: a sentencepiece model")
        path, data, self._found, self.source = found.path, found.data, found, found.source
        self._spec, self._kwargs = spec, {"eos": eos, "bos": bos}
        self._data, self.name = data, os.path.basename(path)
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=data)
        except Exception as e:
            raise TokenizerError(f"{path}: not a sentencepiece model: {e}") from e
        self.vocab_size = self._sp.get_piece_size()
        self.eos_id = self._piece_id(eos, "eos", self._sp.eos_id())
        self.bos_id = self._piece_id(bos, "bos", self._sp.bos_id())
        if self.eos_id is None:
            raise TokenizerError(f"{path} has no EOS token; pass eos='…' (a piece of the model)")

    def _piece_id(self, piece: str | None, what: str, own: int) -> int | None:
        if piece is None:
            return own if own >= 0 else None
        token_id = self._sp.piece_to_id(piece)
        if self._sp.id_to_piece(token_id) != piece:
            raise TokenizerError(f"{self._spec}: {what}={piece!r} is not a piece of the model")
        return token_id

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        texts = list(texts)
        try:
            ids = self._sp.encode(texts, out_type=int, num_threads=1)  # caller runs processes
        except (TypeError, UnicodeEncodeError, RuntimeError):
            ids = self._sp.encode([scrub(t) for t in texts], out_type=int, num_threads=1)
        return [np.array(x, np.int32) for x in ids]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._sp.decode(np.asarray(ids).tolist())

    def identity(self) -> dict:
        return _identity("sentencepiece", self.name, self.vocab_size, self.eos_id, self.bos_id,
                         self._data, self._found.asked)

    def __reduce__(self):
        return _reload, (self._spec, self._kwargs)

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self._spec!r})"


def _tokenizer_json(path: str, data: bytes) -> dict:
    """The parsed tokenizer.json, or a TokenizerError saying why it is not one (not JSON, or JSON
    without a tokenizer's "model"), instead of the tokenizers library's serde error."""
    try:
        config = json.loads(data)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise TokenizerError(f"{path}: not a Hugging Face tokenizer.json: not JSON ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        has = (f"an object with keys {sorted(config)[:8]}" if isinstance(config, dict)
               else f"a JSON {type(config).__name__}")
        raise TokenizerError(f"{path}: not a Hugging Face tokenizer.json (it holds {has}, no "
                             "\"model\"); pass the tokenizer.json saved with the model, e.g. by "
                             "tokenizer.save_pretrained()")
    return config


class HFTokenizer:
    """A Hugging Face tokenizer.json, run by the fastest engine proven to give its ids."""

    kind = "hf"

    def __init__(self, found: TokenizerFile, *, engine: str, eos: str | None, bos: str | None,
                 spec: str):
        from tokenizers import Tokenizer as HFTok

        path, data, self._found, self.source = found.path, found.data, found, found.source
        self._spec, self._kwargs = spec, {"eos": eos, "bos": bos}
        self._data, self.name = data, os.path.basename(path)
        config = _tokenizer_json(path, data)
        try:
            self._hf = HFTok.from_str(data.decode("utf-8"))
        except Exception as e:
            raise TokenizerError(f"{path}: not a Hugging Face tokenizer.json: {e}") from e
        self._hf.no_truncation()  # a file's max_length (e.g. 512) must not cut documents
        self._hf.no_padding()
        vocab = self._hf.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        specials = [t["content"] for t in config.get("added_tokens") or [] if t.get("special")]
        self.eos_id = self._token_id(eos, "eos", EOS_CANDIDATES, specials)
        self.bos_id = self._token_id(bos, "bos", BOS_CANDIDATES, specials)
        self._eos_from = None
        if eos is None and self.eos_id is None and found.eos is not None:
            self.eos_id, self._eos_from = self._hinted_id(found.eos, "eos"), found.eos_from
        if bos is None and self.bos_id is None and found.bos is not None:
            self.bos_id = self._hinted_id(found.bos, "bos")
        if self.eos_id is None:
            raise TokenizerError(f"{path} has no EOS token; pass eos='…' (its special tokens: "
                                 f"{specials[:20]}; no tokenizer_config.json beside it names one)")
        try:
            self._engine, self.engine_notes = choose_engine(self._hf, data, config, self.name,
                                                            engine)
        except NoFastPath as e:
            raise TokenizerError(f"{path}: engine {engine!r} cannot run it: {e}; use engine='auto' "
                                 "(the fastest engine proven identical) or 'hf'") from None
        self.engine = self._engine.name
        self._kwargs["engine"] = "hf" if self.engine == "tokenizers" else self.engine
        if engine == "auto" and self.engine == "tokenizers":
            message = (f"tokenmill: {path}: encoding with tokenizers (slow): "
                       + "; ".join(self.engine_notes))
            if message not in _WARNED:
                _WARNED.add(message)
                warnings.warn(message, stacklevel=3)

    def _token_id(self, text: str | None, what: str, candidates: tuple, specials: list):
        if text is not None:
            token_id = self._hf.token_to_id(text)
            if token_id is None:
                raise TokenizerError(f"{self._spec}: {what}={text!r} is not in its vocabulary")
            return token_id
        found = [c for c in candidates if c in specials]
        return self._hf.token_to_id(found[0]) if found else None

    def _hinted_id(self, hint: str | int, what: str) -> int:
        """The id of the token tokenizer_config.json (text) or generation_config.json (id) names."""
        token_id = self._hf.token_to_id(hint) if isinstance(hint, str) else hint
        if token_id is None or not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"{self._found.path}: the {what} token {hint!r} named beside it "
                                 f"(tokenizer_config.json / generation_config.json) is not in its "
                                 f"vocabulary; pass {what}='…'")
        return token_id

    @property
    def tiktoken_encoding(self):
        """The equivalent tiktoken ``Encoding`` when tiktoken runs with ids = ranks, else None."""
        e = self._engine
        return e.enc if e.name == "tiktoken" and e.lut is None else None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return self._engine.encode_batch(texts)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._hf.decode(np.asarray(ids).tolist(), skip_special_tokens=False)

    def identity(self) -> dict:  # engine left out: every engine gives the same ids
        return _identity("hf", self.name, self.vocab_size, self.eos_id, self.bos_id, self._data,
                         self._found.asked, self._eos_from)

    def __reduce__(self):  # a worker re-creates (and re-proves) the very engine chosen here
        return _reload, (self._spec, self._kwargs, self.engine_notes)

    def __repr__(self) -> str:
        return f"HFTokenizer({self._spec!r}, engine={self.engine!r})"


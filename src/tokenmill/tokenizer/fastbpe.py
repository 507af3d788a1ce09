r"""Engines for a tokenizer.json: the fastest one proven to give `tokenizers`' ids runs it.

load_tokenizer(train_bpe(texts, 32000, out_path="tokenizer.json")).engine == "fastokens"

    engine       what runs the BPE                      taken when
    fastokens    fastokens (pip install 'tokenmill[fast]')  it loads the file, and the proof holds
    tiktoken     an equivalent tiktoken Encoding        the conditions below, and the proof holds
    tokenizers   Hugging Face tokenizers itself         always: the reference the others are proven on

choose_engine tries them in that order (issue 13, GPT-2 BPE on 2 cores: 62, 13.7 and 3.5 MB/s) and
returns the first that loads and gives, on a built-in sample, exactly the ids `tokenizers` gives
(PROOF_SAMPLE: code, prose in eight scripts, whitespace and digit runs, emoji, every added token
in several contexts, text cycled from all of these, and long documents of ~150 KB that cross
fastokens' parallel chunks). Why each faster engine was refused is kept as a note ("fastokens:
fastokens cannot load it: … unsupported normalizer type: NFKC"). An engine asked for by name is
that engine or a NoFastPath saying why not.

fastokens is refused when FASTOKENS_INPUT_CACHE is set: its prefix cache has given ids that depend
on the text encoded before (seen in fastokens 0.3.2 on `\s+(?!\S)` patterns), which no proof on a
sample can rule out. Its segment cache is switched off (it is for chat traffic).

tiktoken_twin builds the tiktoken Encoding; a tokenizer.json takes it when all of these hold:
  - model BPE: no dropout, continuing_subword_prefix or end_of_word_suffix; every one of the 256
    byte symbols in the vocab; merges whose results keep one priority each (a token made by several
    merges only if they are adjacent in the merge list, as in tiktoken-converted Llama 3 files);
  - no normalizer (or an empty Sequence);
  - pre-tokenizer ByteLevel(use_regex=True, add_prefix_space=False) (GPT-2 regex, taken from
    tiktoken_ext.openai_public.r50k_pat_str), or Sequence[Split(Regex, Isolated),
    ByteLevel(use_regex=False, add_prefix_space=False)] (Llama 3 style: that regex);
  - added tokens without lstrip/rstrip/single_word and none a prefix of another (they are matched
    as tiktoken special tokens, as `tokenizers` splits on them even with add_special_tokens=False);
  - with ignore_merges=False, every merged token encodes to itself (tiktoken looks whole pieces up
    in the vocab first); with ignore_merges=True (as tokenizers does then), no vocab token that no
    merge makes;
  - tiktoken compiles the regex, and the proof holds. The regex engines differ: e.g. Oniguruma
    (tokenizers) reads `$` as end of line and `\p{N}{1,3}+` as "1-3 digits, repeated", fancy-regex
    (tiktoken) and PCRE2 (fastokens) as end of text and possessive; such files fail the proof.
Ranks are the vocab ids when those rise with merge order (files trained by tokenizers or converted
from tiktoken); otherwise ranks follow merge order and ids are mapped back through a lookup table.

The calls that run each engine live here, below tokenmill.tokenizer, so that the proof runs the
very functions HFTokenizer encodes with.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np

from tokenmill.base.errors import ConfigError, TokenizerError

__all__ = ["ENGINES", "ENGINE_CHOICES", "FastokensEngine", "NoFastPath", "PROOF_SAMPLE",
           "TiktokenEngine", "TokenizersEngine", "choose_engine", "encode_np", "fastokens_engine",
           "hf_encode", "proof_sample", "prove", "scrub", "tiktoken_engine", "tiktoken_twin"]

ENGINES = ("fastokens", "tiktoken", "tokenizers")  # fastest first
ENGINE_CHOICES = ("auto", "fastokens", "tiktoken", "hf")  # "hf": tokenizers itself, no substitute


class NoFastPath(Exception):
    """Why a tokenizer.json cannot be run by a faster engine."""


def scrub(text: str) -> str:
    """Text with lone surrogates replaced by U+FFFD (what tiktoken does), so UTF-8 can hold it.

    scrub("a\\ud800b") == "a\\ufffdb"
    """
    if not isinstance(text, str):
        raise TokenizerError(f"texts must be str (got {type(text).__name__})")
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def encode_np(enc, text: str, allowed: frozenset) -> np.ndarray:
    """One text through a tiktoken Encoding as a uint32 array (encode_to_numpy: no Python list)."""
    try:
        return enc.encode_to_numpy(text, allowed_special=allowed, disallowed_special=())
    except UnicodeEncodeError:  # encode_to_numpy lacks encode()'s surrogate fallback
        return enc.encode_to_numpy(scrub(text), allowed_special=allowed, disallowed_special=())


def hf_encode(hf, texts: list) -> list[np.ndarray]:
    """Texts through a `tokenizers` Tokenizer, without special tokens, as uint32 arrays."""
    batch = getattr(hf, "encode_batch_fast", hf.encode_batch)  # _fast: no offsets (tokenizers>=0.20)
    try:
        encodings = batch(texts, add_special_tokens=False)
    except (TypeError, UnicodeEncodeError):  # lone surrogates reach Rust as invalid str
        encodings = batch([scrub(t) for t in texts], add_special_tokens=False)
    return [np.array(e.ids, np.uint32) for e in encodings]


# ---- the engines: encode_batch(texts) -> one uint32 array per text ------------------------------

class TokenizersEngine:
    """Hugging Face `tokenizers` itself: the reference the other engines are proven against."""

    name = "tokenizers"

    def __init__(self, hf):
        self.hf = hf

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Ids of each text, no special tokens added."""
        return hf_encode(self.hf, list(texts))


class TiktokenEngine:
    """A tiktoken Encoding equivalent to the file, ids mapped back through `lut` if given."""

    name = "tiktoken"

    def __init__(self, enc, lut: np.ndarray | None, allowed: frozenset):
        self.enc, self.lut, self.allowed = enc, lut, allowed

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Ids of each text; added tokens in the text become their ids, as in `tokenizers`."""
        ids = [encode_np(self.enc, t, self.allowed) for t in texts]
        return ids if self.lut is None else [self.lut[x] for x in ids]


class FastokensEngine:
    """A fastokens Tokenizer; a batch comes back as one flat buffer (no per-token objects)."""

    name = "fastokens"

    def __init__(self, ft):
        self.ft = ft

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Ids of each text (views into one buffer), no special tokens added."""
        texts = list(texts)
        if not texts:
            return []
        try:
            flat, offsets = self.ft.encode_batch_flat(texts, add_special_tokens=False)
        except (TypeError, UnicodeEncodeError):  # lone surrogates; non-str raise in scrub
            flat, offsets = self.ft.encode_batch_flat([scrub(t) for t in texts],
                                                      add_special_tokens=False)
        ids = np.frombuffer(flat, np.dtype("<u4"))
        ends = np.frombuffer(offsets, np.dtype("<u8"))[1:-1].astype(np.intp)
        return np.split(ids, ends)


def fastokens_engine(data: bytes) -> FastokensEngine:
    """fastokens loaded from the tokenizer.json bytes (not yet proven), or raise NoFastPath."""
    try:
        import fastokens
    except ImportError:
        raise NoFastPath("not installed (pip install 'tokenmill[fast]')") from None
    if os.environ.get("FASTOKENS_INPUT_CACHE"):
        raise NoFastPath("FASTOKENS_INPUT_CACHE is set: its prefix cache has made ids depend on "
                         "the text encoded before; unset it to use fastokens")
    try:
        ft = fastokens.Tokenizer.from_json_str(data.decode("utf-8"))
    except BaseException as e:  # ValueError for what it does not support; the core may panic
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise NoFastPath(f"fastokens cannot load it: {e}") from None
    ft.no_truncation()  # a file's max_length (e.g. 512) must not cut documents
    ft.no_padding()
    ft.enable_segment_cache(0)
    return FastokensEngine(ft)


def tiktoken_engine(hf, config: dict, name: str) -> TiktokenEngine:
    """The tiktoken twin of the file (not yet proven), or raise NoFastPath."""
    return TiktokenEngine(*tiktoken_twin(hf, config, name))


def choose_engine(hf, data: bytes, config: dict, name: str, wanted: str = "auto"):
    """(engine, notes): the fastest engine proven to give `hf`'s ids and why faster ones were
    refused; an engine asked for by name, or NoFastPath saying why it cannot run the file."""
    wanted = "hf" if wanted == "tokenizers" else wanted
    if wanted not in ENGINE_CHOICES:
        raise ConfigError(f"tokenizer engine must be one of {', '.join(ENGINE_CHOICES)} "
                          f"(got {wanted!r})")
    order = ENGINES if wanted == "auto" else ("tokenizers" if wanted == "hf" else wanted,)
    notes: list[str] = [] if wanted == "auto" else [f"asked for: engine={wanted!r}"]
    want: dict = {}  # the reference ids, computed once for every engine tried
    for engine_name in order:
        if engine_name == "tokenizers":
            return TokenizersEngine(hf), tuple(notes)
        try:
            engine = (fastokens_engine(data) if engine_name == "fastokens"
                      else tiktoken_engine(hf, config, name))
            if not want:
                want["sample"] = proof_sample(t["content"] for t in config.get("added_tokens") or [])
                want["ids"] = hf_encode(hf, want["sample"])
            prove(engine, want["sample"], want["ids"])
            return engine, tuple(notes)
        except NoFastPath as e:
            if wanted != "auto":
                raise
            notes.append(f"{engine_name}: {e}")
    raise AssertionError("unreachable: tokenizers always runs")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocab strings are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tiktoken_twin(hf, config: dict, name: str):
    """(Encoding, id lookup table or None, added tokens to split on), or raise NoFastPath.

    Not proven here: choose_engine proves every engine the same way."""
    import tiktoken

    model = config.get("model") or {}
    _check_model(model)
    pat_str = _pattern(config.get("pre_tokenizer"))
    normalizer = config.get("normalizer")
    if normalizer and not (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")):
        raise NoFastPath(f"normalizer {normalizer.get('type')} changes text before BPE")
    added = _added_tokens(hf, config)
    ranks, result_order = _merge_ranks(model, added)
    _check_whole_tokens(hf, model, result_order)
    vocab = model["vocab"]
    ids_in_order = [vocab[t] for t in result_order]
    if all(a < b for a, b in zip(ids_in_order, ids_in_order[1:])):
        lut = None  # ids rise with merge priority: they are the ranks
        mergeable = {b: vocab[t] for t, b in ranks.items()}
        specials = {t["content"]: t["id"] for t in added}
    else:  # rank = merge position; map ranks back to ids after encoding
        order = {t: i for i, t in enumerate(result_order)}
        mergeable = {b: (b[0] if len(b) == 1 else 256 + order[t]) for t, b in ranks.items()}
        specials = {t["content"]: 256 + len(order) + i for i, t in enumerate(added)}
        lut = np.zeros(256 + len(order) + len(added), np.uint32)
        for t, b in ranks.items():
            lut[mergeable[b]] = vocab[t]
        for t in added:
            lut[specials[t["content"]]] = t["id"]
    try:
        enc = tiktoken.Encoding(f"tokenmill-{name}", pat_str=pat_str, mergeable_ranks=mergeable,
                                special_tokens=specials)
    except BaseException as e:  # fancy-regex rejects some Oniguruma syntax; the core may panic
        raise NoFastPath(f"tiktoken cannot build it: {e}") from None
    return enc, lut, frozenset(specials)


def _check_model(model: dict) -> None:
    if model.get("type") != "BPE":
        raise NoFastPath(f"model is {model.get('type')}, not BPE")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise NoFastPath(f"BPE {key}={model[key]!r}")


def _pattern(pre: dict | None) -> str:
    """tiktoken's pat_str for a pre-tokenizer it can reproduce."""
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's regex, possessive form

    steps = []
    for step in [pre] if pre else []:
        steps += step.get("pretokenizers", []) if step.get("type") == "Sequence" else [step]

    def byte_level(step: dict, use_regex: bool) -> bool:
        return (step.get("type") == "ByteLevel" and step.get("use_regex", True) == use_regex
                and not step.get("add_prefix_space", True))

    if len(steps) == 1 and byte_level(steps[0], True):
        return r50k_pat_str
    if (len(steps) == 2 and steps[0].get("type") == "Split" and byte_level(steps[1], False)
            and "Regex" in steps[0].get("pattern", {})
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert")):
        return steps[0]["pattern"]["Regex"]
    shown = [s.get("type") for s in steps]
    raise NoFastPath(f"pre-tokenizer {shown} is not ByteLevel(use_regex=True) or "
                      "[Split(Regex, Isolated), ByteLevel(use_regex=False)] without prefix space")


def _added_tokens(hf, config: dict) -> list[dict]:
    """Added tokens, which tokenizers splits the text on before BPE; checked tiktoken can too."""
    if hf.encode_special_tokens:
        raise NoFastPath("encode_special_tokens=True")
    added = config.get("added_tokens") or []
    for t in added:
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            raise NoFastPath(f"added token {t['content']!r} has lstrip/rstrip/single_word")
    contents = sorted(t["content"] for t in added)
    for a, b in zip(contents, contents[1:]):  # sorted: a prefix of any is a prefix of the next
        if b.startswith(a):  # tokenizers takes the longest match, tiktoken the first
            raise NoFastPath(f"added token {a!r} is a prefix of {b!r}")
    if len({bool(t.get("normalized")) for t in added}) > 1:  # two matching passes in tokenizers
        if len(contents) > 1000:
            raise NoFastPath(f"{len(contents)} added tokens, some normalized, some not")
        for a in contents:
            for b in contents:
                if a != b and (a in b or any(b.startswith(a[i:]) for i in range(1, len(a)))):
                    raise NoFastPath(f"added tokens {a!r} and {b!r} overlap")
    return added


def _merge_ranks(model: dict, added: list[dict]) -> tuple[dict[str, bytes], list[str]]:
    """Vocab string -> bytes for the byte symbols and merge results, and the results in order."""
    unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    vocab, added_ids = model.get("vocab") or {}, {t["id"] for t in added}
    missing = [c for c in unicode_to_byte if c not in vocab]
    if missing:
        raise NoFastPath(f"{len(missing)} of the 256 byte symbols are not in the vocab "
                          f"(e.g. {missing[0]!r}): not a byte-level vocab")
    ranks = {c: bytes([b]) for c, b in unicode_to_byte.items()}
    result_order: list[str] = []
    for i, merge in enumerate(model.get("merges") or []):
        pair = merge.split(" ") if isinstance(merge, str) else merge
        token = "".join(pair)
        if len(pair) != 2 or token not in vocab:
            raise NoFastPath(f"merge {i} {merge!r} does not make a vocab token")
        if result_order and token == result_order[-1]:
            continue
        if token in ranks:  # made again after other merges: its priority is not one rank
            raise NoFastPath(f"merge {i} {merge!r} makes {token!r} again after other merges")
        try:
            ranks[token] = bytes(unicode_to_byte[c] for c in token)
        except KeyError:
            raise NoFastPath(f"vocab token {token!r} is not byte-level") from None
        result_order.append(token)
    orphans = [t for t, i in vocab.items() if t not in ranks and i not in added_ids]
    if orphans and model.get("ignore_merges"):  # tokenizers would emit them for whole words
        raise NoFastPath(f"{len(orphans)} vocab tokens (e.g. {orphans[0]!r}) come from no merge")
    return ranks, result_order


def _check_whole_tokens(hf, model: dict, result_order: list[str]) -> None:
    """tiktoken emits a piece found in the vocab as is; tokenizers (ignore_merges=False) merges."""
    if model.get("ignore_merges"):
        return
    vocab = model["vocab"]
    for token in result_order:
        got = [t.id for t in hf.model.tokenize(token)]
        if got != [vocab[token]]:
            raise NoFastPath(f"vocab token {token!r} does not encode to itself ({got})")


PROOF_SAMPLE = (
    "It's John's book; they'll say we've done what I'd've thought. DON'T shout, you're RIGHT'S.",
    "x'S 'll 're 'VE 'd 'M 'T  ''quoted'' \"double\" — em dash – en dash … ellipsis",
    "def f(x):\n    return x ** 2  # square\n\n\n\tif x:\n\t\tpass\n    \n  \n",
    "1234567890 3.14159 1,000,000 2024-06-01T12:30:00Z 0x1F 1e-9 -42 +7 ½ ٣٤٥ Ⅻ ①②",
    "12345678901234567890 00 007 9999999 v1.2.3 $19.99 100% 10^6 2³ ²",
    "a  b   c    d\n\n\n  \n\t \t end   ", "   leading", "trailing   ", "\n", " ", "  ", "",
    "\r\n\r\nwindows line\r\nends\r\n", "\x0b\x0c form feed \x00\x01\x7f controls",
    "\u00a0nbsp\u2003em space\u3000ideographic\u200bzero width\u2028line sep\u2029para",
    "😀👍🏽 👨‍👩‍👧 🇫🇷🇯🇵 ❤️ ✨🎉", "日本語のテキスト、中文文本。한국어 텍스트입니다.",
    "Ça va? naïve café, Straße, façade, ÅÄÖ åäö, e\u0301 combining, ǅ title, ﬁ ligature",
    "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم. नमस्ते दुनिया। สวัสดีชาวโลก שלום",
    "<html><body class=\"x\">&amp; <|endoftext|> <s> </s> [CLS]</body></html>",
    "!!!???...---*** $var @user #tag ~/path/to/file.txt C:\\Users\\me https://x.io/?a=1&b=2",
    "a" * 60 + " " + "=" * 80 + " " * 100 + "\n" * 10 + "ab" * 40,
    "abc123def456 x1 1x ..1.. __init__ camelCaseWord snake_case_word SHOUTING_CASE",
    "Mixed\tTabs \t\n\t\nand  \n spaces   \n\n\nend.\n",
)

LONG_RUNS = (" " * 5000 + "x", "\n" * 2000 + "y", "\t \n" * 700, "0123456789" * 500,
             "ab" * 1500, "😀" * 600, "日本語" * 800, "-" * 3000 + ">", "x" + " \n" * 900)


def proof_sample(added: Iterable[str] = ()) -> list[str]:
    """The texts an engine must encode exactly as `tokenizers` does: PROOF_SAMPLE, long runs,
    each added token (up to 300) in several contexts, text cycled from all of these, and two long
    documents (~150 KB: many of fastokens' 16,384-split parallel chunks).

    proof_sample()[0] == PROOF_SAMPLE[0]
    """
    sample = list(PROOF_SAMPLE) + list(LONG_RUNS)
    tokens = sorted(set(added))[:300]
    sample += [f"x{a}y {a} {a}{a}\n{a}. \t{a}\n\n" for a in tokens]
    if tokens:
        sample.append(" ".join(tokens) + "".join(tokens))
    pieces = [w for text in PROOF_SAMPLE for w in text.split(" ")] + tokens
    # deterministic mixing: every piece appears, neighbours vary (7919 is prime)
    sample += [" ".join(pieces[(i * 7919 + k) % len(pieces)] for i in range(40))
               for k in range(64)]
    prose = "\n".join(sample[:len(PROOF_SAMPLE)])
    sample.append("".join(sample[len(PROOF_SAMPLE):]))  # the runs, tokens and mixes at once
    sample.append((prose + "\n\n") * (150_000 // len(prose)))
    return sample


def prove(engine, sample: list[str], want: list[np.ndarray]) -> None:
    """The engine's ids on `sample` (one batch) must be `want`, text by text, or NoFastPath."""
    got = engine.encode_batch(sample)
    if len(got) != len(want):
        raise NoFastPath(f"{engine.name} returned {len(got)} results for {len(want)} texts")
    for text, g, w in zip(sample, got, want):
        if not np.array_equal(g, w):
            at = next((i for i, (a, b) in enumerate(zip(g.tolist(), w.tolist())) if a != b),
                      min(len(g), len(w)))
            raise NoFastPath(f"{engine.name} and tokenizers disagree on {text[:60]!r} "
                             f"(token {at}: {g[at:at + 3].tolist()} vs {w[at:at + 3].tolist()})")

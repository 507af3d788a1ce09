r"""Run a byte-level BPE tokenizer.json on tiktoken, after proving both engines give the same ids.

load_tokenizer(train_bpe(texts, 32000, out_path="tokenizer.json")).engine == "tiktoken"

tiktoken's BPE engine encodes byte-level BPE about 4x faster than `tokenizers` with the same ids.
tiktoken_twin builds the equivalent tiktoken Encoding; a tokenizer.json takes it when all of these
hold (otherwise tiktoken_twin raises NoFastPath saying why, and HFTokenizer in tokenmill.tokenizer
falls back to `tokenizers` and warns once):
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
  - tiktoken compiles the regex, and both engines give identical ids on a built-in multilingual
    sample (_PROOF_SAMPLE plus every added token) at load time. The regex engines differ: e.g.
    Oniguruma (tokenizers) reads `$` as end of line and `\p{N}{1,3}+` as "1-3 digits, repeated",
    fancy-regex (tiktoken) as end of text and possessive; such files fail the proof and fall back.
Ranks are the vocab ids when those rise with merge order (files trained by tokenizers or converted
from tiktoken); otherwise ranks follow merge order and ids are mapped back through a lookup table.
Not taken (yet): normalizers such as Qwen2's NFC, several Splits in a row (DeepSeek-V3), Metaspace.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NoFastPath", "tiktoken_twin"]


class NoFastPath(Exception):
    """Why a tokenizer.json cannot be run by tiktoken."""


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
    """(Encoding, id lookup table or None, added tokens to split on), or raise NoFastPath."""
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
    allowed = frozenset(specials)
    _prove(hf, enc, lut, allowed)
    return enc, lut, allowed


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


_PROOF_SAMPLE = (
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


def _prove(hf, enc, lut, allowed: frozenset) -> None:
    """Both engines must give identical ids on the built-in sample, or no fast path."""
    # the very functions HFTokenizer encodes with; imported here as tokenizer imports this module
    from tokenmill.tokenizer import _encode_np, _hf_encode

    sample = list(_PROOF_SAMPLE)
    sample += [f"x{a}y {a} {a}{a}\n{a}." for a in sorted(allowed)[:300]]
    sample.append("\n".join(sample))
    want = _hf_encode(hf, sample)
    for text, w in zip(sample, want):
        got = _encode_np(enc, text, allowed)
        if lut is not None:
            got = lut[got]
        if not np.array_equal(got, w):
            raise NoFastPath(f"tiktoken and tokenizers disagree on {text[:60]!r}")

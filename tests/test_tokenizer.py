"""Tokenizers: exact ids per kind, EOS/BOS, identity, documents, errors (fast path: test_fastbpe)."""

import base64
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Regex, Tokenizer as HFTok, models  # noqa: E402
from tokenizers import pre_tokenizers, trainers  # noqa: E402

from conftest import FRAGMENTS, MULTILINGUAL, edited, ids_of, training_texts  # noqa: E402

from tokenmill.base.errors import ConfigError, TokenizerError  # noqa: E402
from tokenmill.tokenizer.files import openai_params  # noqa: E402
from tokenmill.tokenizer.fastbpe import _bytes_to_unicode, scrub  # noqa: E402
from tokenmill.tokenizer import (  # noqa: E402
    encode_documents, load_tokenizer, token_dtype, train_bpe,
)

# ---- bytes --------------------------------------------------------------------------------------

def test_bytes_exact_ids_and_constants():
    tok = load_tokenizer("bytes")
    assert (tok.kind, tok.engine, tok.vocab_size, tok.eos_id, tok.bos_id) == \
        ("bytes", "bytes", 258, 256, 257)
    out = tok.encode_batch(["hi", "é€😀", ""])
    assert [x.tolist() for x in out] == [[104, 105], list("é€😀".encode()), []]
    assert out[0].dtype == np.uint8
    assert load_tokenizer().identity() == {"kind": "bytes", "name": "bytes", "vocab_size": 258,
                                           "eos_id": 256, "bos_id": 257, "file_xxh3": None}


@given(st.text())
def test_bytes_round_trip(text):
    tok = load_tokenizer("bytes")
    assert tok.decode(tok.encode_batch([text])[0]) == text


def test_bytes_decode_shows_specials_and_replaces_bad_utf8():
    tok = load_tokenizer("bytes")
    assert tok.decode([257, 104, 105, 256]) == "<|startoftext|>hi<|endoftext|>"
    assert tok.decode(np.array([0xFF, 104], np.uint16)) == "\ufffdh"
    with pytest.raises(TokenizerError, match="0..257"):
        tok.decode([300])


def test_lone_surrogates_do_not_crash(gpt2_json):
    assert load_tokenizer("bytes").encode_batch(["a\ud800b"])[0].tolist() == \
        list("a\ufffdb".encode())
    fast, slow = load_tokenizer(gpt2_json), load_tokenizer(gpt2_json, fast=False)
    texts = ["a\ud800b", "ok", "\ud83d\ude00 pair"]
    assert ids_of(fast, texts) == ids_of(slow, texts) == ids_of(slow, [scrub(t) for t in texts])


def test_bytes_rejects_eos_bos():
    with pytest.raises(TokenizerError, match="fixed ids"):
        load_tokenizer("bytes", eos="</s>")


# ---- Hugging Face: EOS / BOS, truncation ----------------------------------------------------

def test_truncation_in_the_file_is_ignored(gpt2_json, tmp_path):
    def truncate(config):
        config["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst",
                                "stride": 0}
    path = edited(gpt2_json, tmp_path / "tokenizer.json", truncate)
    want = ids_of(load_tokenizer(gpt2_json), MULTILINGUAL)
    assert ids_of(load_tokenizer(path), MULTILINGUAL) == want
    assert ids_of(load_tokenizer(path, fast=False), MULTILINGUAL) == want


def test_hf_eos_bos_detection(gpt2_json, llama3_json, tmp_path):
    assert load_tokenizer(gpt2_json).eos_id == 0 and load_tokenizer(gpt2_json).bos_id is None
    llama = load_tokenizer(llama3_json)
    assert (llama.bos_id, llama.eos_id) == (0, 1)
    assert load_tokenizer(gpt2_json, eos="a", bos="<|endoftext|>").eos_id == \
        load_tokenizer(gpt2_json, fast=False).encode_batch(["a"])[0][0]

    def no_eos(config):
        config["added_tokens"][0]["content"] = "<pad>"
    with pytest.raises(TokenizerError, match="has no EOS token; pass eos="):
        load_tokenizer(edited(gpt2_json, tmp_path / "t.json", no_eos))
    with pytest.raises(TokenizerError, match="not in its vocabulary"):
        load_tokenizer(gpt2_json, eos="<not-there>")


# ---- tiktoken files --------------------------------------------------------------------------

def write_tiktoken(hf_json: str, path: Path) -> Path:
    """The HF BPE's byte tokens and merged tokens, ranked by their ids (what tiktoken needs)."""
    config = json.loads(Path(hf_json).read_text(encoding="utf-8"))
    decode = {c: b for b, c in _bytes_to_unicode().items()}
    added = {t["content"] for t in config["added_tokens"]}
    lines = [f"{base64.b64encode(bytes(decode[c] for c in t)).decode()} {i}"
             for t, i in config["model"]["vocab"].items() if t not in added]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_tiktoken_file_matches_fast_path(tmp_path):
    # an HF BPE splitting like cl100k, the regex a .tiktoken file not named by OpenAI gets.
    # Oniguruma reads cl100k's possessive `\p{N}{1,3}+` as "1-3 digits, repeated": drop the `+`
    cl100k = openai_params("cl100k_base", {})["pat_str"]
    hf = HFTok(models.BPE(ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(cl100k.replace(r"\p{N}{1,3}+", r"\p{N}{1,3}")),
                             behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.train_from_iterator(training_texts(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    hf.save(str(tmp_path / "tokenizer.json"))
    fast = load_tokenizer(str(tmp_path / "tokenizer.json"))
    twin = load_tokenizer(str(tmp_path / "tokenizer.json"), engine="tiktoken")
    assert (fast.engine, twin.engine) == ("fastokens", "tiktoken")
    tok = load_tokenizer(str(write_tiktoken(str(tmp_path / "tokenizer.json"),
                                            tmp_path / "mini.tiktoken")))
    # ranks 1..599 (id 0 is <|endoftext|> in the HF file); EOS comes after the last rank
    assert (tok.kind, tok.engine, tok.vocab_size, tok.eos_id, tok.bos_id) == \
        ("tiktoken", "tiktoken", 601, 600, None)
    texts = training_texts() + FRAGMENTS[1:-3]  # no special-token strings: tiktoken keeps them text
    assert ids_of(tok, texts) == ids_of(fast, texts) == ids_of(twin, texts)
    assert tok.decode(tok.encode_batch([texts[0]])[0]) == texts[0]
    assert tok.encode_batch(["<|endoftext|>"])[0].tolist() != [tok.eos_id]  # text stays text
    assert tok.identity()["name"] == "mini.tiktoken" and tok.identity()["file_xxh3"]


def test_tiktoken_openai_names(gpt2_json, tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    assert openai_params("o200k_base", ranks)["special_tokens"]["<|endoftext|>"] == 199999
    assert "\\p{N}{1,3}" in openai_params("o200k_harmony", ranks)["pat_str"]
    small = write_tiktoken(gpt2_json, tmp_path / "r50k_base.tiktoken")
    with pytest.raises(TokenizerError, match="named like OpenAI's r50k_base"):
        load_tokenizer(str(small))
    cl100k = load_tokenizer(str(write_tiktoken(gpt2_json, tmp_path / "cl100k_base.tiktoken")))
    assert (cl100k.eos_id, cl100k.vocab_size) == (100257, 100277)  # OpenAI's special ids
    with pytest.raises(TokenizerError, match="not one of its special tokens"):
        load_tokenizer(str(write_tiktoken(gpt2_json, tmp_path / "x.tiktoken")), eos="</s>")


# ---- sentencepiece ---------------------------------------------------------------------------

def test_sentencepiece(tmp_path):
    import sentencepiece as spm

    lines = [line for t in training_texts() for line in t.splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                   vocab_size=200, minloglevel=2)
    path = tmp_path / "sp.model"
    path.write_bytes(model.getvalue())
    tok = load_tokenizer(str(path))
    ref = spm.SentencePieceProcessor(model_file=str(path))
    texts = MULTILINGUAL + ["", "<|endoftext|> </s>", "a\ud800b"]
    assert ids_of(tok, texts[:-1]) == ref.encode(texts[:-1], out_type=int)
    assert (tok.kind, tok.engine, tok.vocab_size) == ("sentencepiece", "sentencepiece", 200)
    assert (tok.eos_id, tok.bos_id) == (ref.eos_id(), ref.bos_id()) == (2, 1)
    assert tok.decode(tok.encode_batch([MULTILINGUAL[0]])[0]) == ref.decode(
        ref.encode(MULTILINGUAL[0]))
    assert len(tok.encode_batch(texts)[-1]) > 0
    assert load_tokenizer(str(path), eos="<unk>").eos_id == 0
    with pytest.raises(TokenizerError, match="not a piece"):
        load_tokenizer(str(path), eos="<nope>")


# ---- identity, pickling ----------------------------------------------------------------------

def test_identity_follows_the_file(gpt2_json, tmp_path):
    a = load_tokenizer(gpt2_json).identity()
    assert json.loads(json.dumps(a)) == a
    assert a == load_tokenizer(gpt2_json, fast=False).identity()
    assert a["name"] == "tokenizer.json" and a["vocab_size"] == 800 and len(a["file_xxh3"]) == 16
    copy = tmp_path / "tokenizer.json"
    copy.write_text(Path(gpt2_json).read_text(encoding="utf-8") + "\n")
    b = load_tokenizer(str(copy)).identity()
    assert b["file_xxh3"] != a["file_xxh3"] and {**b, "file_xxh3": a["file_xxh3"]} == a


@pytest.mark.parametrize("engine", ["auto", "tiktoken", "hf"])
def test_pickle_reloads_the_same_engine(gpt2_json, engine):
    tok = load_tokenizer(gpt2_json, engine=engine)
    back = pickle.loads(pickle.dumps(tok))
    assert (back.engine, back.engine_notes) == (tok.engine, tok.engine_notes)
    assert ids_of(back, MULTILINGUAL) == ids_of(tok, MULTILINGUAL)


# ---- encode_documents, dtypes ----------------------------------------------------------------

def test_token_dtype():
    assert token_dtype(258) == np.uint16 and token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32 and token_dtype(128256) == np.int32
    with pytest.raises(ConfigError):
        token_dtype(0)


def test_encode_documents_bytes():
    tok = load_tokenizer("bytes")
    flat, lengths = encode_documents(tok, ["hi", "", "é"])
    assert flat.tolist() == [104, 105, 256, 256, 0xC3, 0xA9, 256]
    assert flat.dtype == np.uint16 and lengths.dtype == np.int64
    assert lengths.tolist() == [3, 1, 3]
    flat, lengths = encode_documents(tok, ["hi", "é"], add_bos=True, add_eos=False, dtype=np.int32)
    assert flat.tolist() == [257, 104, 105, 257, 0xC3, 0xA9] and flat.dtype == np.int32
    flat, lengths = encode_documents(tok, ["hi", "é"], add_eos=False)
    assert flat.tolist() == [104, 105, 0xC3, 0xA9] and lengths.tolist() == [2, 2]
    flat, lengths = encode_documents(tok, [])
    assert flat.tolist() == [] and lengths.tolist() == [] and flat.dtype == np.uint16
    with pytest.raises(ConfigError, match="cannot hold"):
        encode_documents(tok, ["x"], dtype=np.uint8)


def test_encode_documents_hf(gpt2_json):
    tok = load_tokenizer(gpt2_json)
    texts = MULTILINGUAL + ["", "<|endoftext|>"]
    flat, lengths = encode_documents(tok, texts)
    want = [i for ids in ids_of(tok, texts) for i in ids + [tok.eos_id]]
    assert flat.tolist() == want and flat.dtype == np.uint16
    assert lengths.tolist() == [len(x) + 1 for x in ids_of(tok, texts)]
    with pytest.raises(TokenizerError, match="no BOS token"):
        encode_documents(tok, texts, add_bos=True)


class WideVocab:
    """A stand-in with a vocab too big for uint16: ids from the bytes, shifted up."""

    kind = engine = "fake"
    vocab_size, eos_id, bos_id = 70_000, 69_999, None

    def encode_batch(self, texts):
        return [np.frombuffer(t.encode(), np.uint8).astype(np.int64) + 65_000 for t in texts]

    def identity(self):
        return {"name": "wide"}


def test_encode_documents_wide_vocab_is_int32():
    flat, lengths = encode_documents(WideVocab(), ["ab", "c"])
    assert flat.dtype == np.int32 and flat.tolist() == [65097, 65098, 69999, 65099, 69999]
    assert lengths.tolist() == [3, 2]


# ---- bad specs, train_bpe --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["missing.json", "missing.tiktoken", "missing.model"])
def test_missing_file(tmp_path, name):
    path = str(tmp_path / name)
    with pytest.raises(TokenizerError, match="not found") as e:
        load_tokenizer(path)
    assert path in str(e.value) and ".tiktoken" in str(e.value)


def test_unknown_and_broken_specs(tmp_path):
    with pytest.raises(TokenizerError, match="unknown tokenizer spec 'gpt-17'") as e:
        load_tokenizer("gpt-17")
    assert "tokenizer.json" in str(e.value) and ".model" in str(e.value)
    for name, content in [("bad.json", "{}"), ("bad.model", "nope"), ("bad.tiktoken", "!! x\n")]:
        (tmp_path / name).write_text(content)
        with pytest.raises(TokenizerError, match="bad"):
            load_tokenizer(str(tmp_path / name))


def test_train_bpe_validates_vocab_size(tmp_path):
    with pytest.raises(ConfigError, match="vocab_size"):
        train_bpe(["abc"], 100, out_path=tmp_path / "t.json")


def test_train_bpe_writes_like_every_writer_and_never_replaces_a_link(tmp_path):
    """Through io's atomic writer: the tokenizer.json it saves (the bytes tokenizers' own save
    writes), no temporary file left beside it, and an out_path that is a link is refused (the
    link and its target untouched) instead of replaced by a file."""
    texts = ["hello world, hello tokenmill"] * 20
    path = train_bpe(texts, 300, out_path=tmp_path / "t.json")
    assert os.listdir(tmp_path) == ["t.json"]
    assert Path(path).read_text() == HFTok.from_file(path).to_str(pretty=True)
    (tmp_path / "target.json").write_text("theirs")
    (tmp_path / "link.json").symlink_to(tmp_path / "target.json")
    with pytest.raises(ConfigError, match="link.json: is a symbolic link"):
        train_bpe(texts, 300, out_path=tmp_path / "link.json")
    assert (tmp_path / "link.json").is_symlink()
    assert (tmp_path / "target.json").read_text() == "theirs"
    assert sorted(os.listdir(tmp_path)) == ["link.json", "t.json", "target.json"]


@pytest.mark.parametrize("content, says", [
    ('{"a": 1}', "(it holds an object with keys ['a'], no \"model\")"),
    ("[1, 2]", "(it holds a JSON list, no \"model\")"),
    ('{"a":', "not JSON (Expecting value"),
])
def test_a_json_that_is_not_a_tokenizer_is_named_as_such_on_the_command_line(tmp_path, content,
                                                                             says):
    (tmp_path / "x.json").write_text(content)
    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n')
    r = subprocess.run([str(Path(sys.executable).with_name("tokenmill")), "prepare", "c.jsonl",
                        "--out", "o", "--tokenizer", "x.json", "--workers", "1"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.startswith("tokenmill prepare: error: x.json: not a Hugging Face tokenizer.json")
    assert says in r.stderr and "expected `,`" not in r.stderr and "struct Tokenizer" not in r.stderr

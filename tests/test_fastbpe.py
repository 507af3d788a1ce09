"""Engine choice for a tokenizer.json: the fastest engine proven identical runs; every tokenizer
family gives `tokenizers`' ids whichever engine runs; a mis-tokenizing engine is caught and refused.

Every tokenizer here is built in the test (trained by `tokenizers` / `sentencepiece`, or edited
from one that was): nothing comes from the network.
"""

import io
import itertools
import json
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest
from conftest import (
    FRAGMENTS, MULTILINGUAL, ids_of, store_bytes, training_texts, write_jsonl,
)
from hypothesis import given, settings, strategies as st
from tokenizers import AddedToken, Regex, Tokenizer as HFTok, decoders, models, normalizers
from tokenizers import pre_tokenizers, trainers

from tokenmill.base.errors import ConfigError, TokenizerError
from tokenmill.tokenizer.fastbpe import PROOF_SAMPLE, FastokensEngine, proof_sample
from tokenmill.tokenizer import encode_documents, load_tokenizer

pytest.importorskip("fastokens")  # the `fast` extra (x86-64 Linux/Windows, macOS wheels)

ENGINES = ["fastokens", "tiktoken", "hf"]
WORDS4 = ["".join(w) for w in itertools.product("etaoinshrdlucmfw", repeat=4)]  # 65,536


def texts_strategy():
    piece = st.one_of(st.text(max_size=12), st.sampled_from(FRAGMENTS),
                      st.text(alphabet=" \t\n\r'sSdl0123456789aA.,", max_size=12))
    return st.lists(piece, max_size=12).map("".join)


def sample_texts() -> list[str]:
    return training_texts() + list(PROOF_SAMPLE) + FRAGMENTS


def train(path, pre, *, vocab=700, normalizer=None, specials=("<|endoftext|>",), texts=None):
    """A byte-level BPE trained on real text with the given pre-tokenizer; its path."""
    tok = HFTok(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts or training_texts(), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(path))
    return str(path)


def byte_level():
    return pre_tokenizers.ByteLevel(add_prefix_space=False)


@pytest.fixture(scope="module")
def large_json(tmp_path_factory) -> str:
    """Vocab 70,000 (> 65,535: int32 ids), trained on real text plus 65,536 distinct words."""
    words = [" ".join(WORDS4[i:i + 4096]) for i in range(0, len(WORDS4), 4096)]
    return train(tmp_path_factory.mktemp("large") / "tokenizer.json", byte_level(),
                 vocab=70_000, texts=training_texts() + words)


@pytest.fixture(scope="module")
def nfkc_json(tmp_path_factory) -> str:
    """A byte-level BPE behind an NFKC normalizer (fastokens and the tiktoken twin refuse it)."""
    return train(tmp_path_factory.mktemp("nfkc") / "tokenizer.json", byte_level(),
                 normalizer=normalizers.NFKC())


@pytest.fixture(scope="module")
def sp_json(tmp_path_factory) -> str:
    """A SentencePiece-style tokenizer.json (Llama 2 / Mistral): ▁ for spaces, byte fallback."""
    tok = HFTok(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(training_texts(), trainers.BpeTrainer(
        vocab_size=900, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.add_tokens([f"<0x{b:02X}>" for b in range(256)])
    path = tmp_path_factory.mktemp("sp") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def dollar_json(tmp_path_factory) -> str:
    """A file both fast engines mis-tokenize: Oniguruma (tokenizers) reads `$` as end of line,
    PCRE2 (fastokens) and fancy-regex (tiktoken) as end of text, so "x  \\ny" splits differently."""
    pattern = r"\s+$|\s|\p{L}+|\p{N}+|[^\s\p{L}\p{N}]+"
    return train(tmp_path_factory.mktemp("dollar") / "tokenizer.json", pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), vocab=600)


def all_engines(path) -> dict:
    """Every engine that can run `path`, by the name it was asked for."""
    out = {"hf": load_tokenizer(path, engine="hf")}
    for name in ("fastokens", "tiktoken"):
        try:
            out[name] = load_tokenizer(path, engine=name)
        except TokenizerError:
            pass
    return out


# ---- auto: the fastest proven engine, the same ids -------------------------------------------

@pytest.mark.parametrize("which", ["gpt2_json", "llama3_json", "large_json", "sp_json"])
def test_auto_runs_fastokens_and_every_engine_gives_the_same_ids(which, request):
    path = request.getfixturevalue(which)
    auto = load_tokenizer(path)
    assert (auto.engine, auto.engine_notes) == ("fastokens", ())
    engines = all_engines(path)
    want = ids_of(engines["hf"], sample_texts())
    assert engines["hf"].engine == "tokenizers"
    for name, tok in engines.items():
        assert ids_of(tok, sample_texts()) == want, name
        assert tok.identity() == auto.identity()  # the store never depends on the engine
    if which != "sp_json":  # a SentencePiece-style BPE has no tiktoken twin
        assert set(engines) == {"hf", "fastokens", "tiktoken"}


def test_large_vocab_ids_above_65535_are_int32(large_json):
    auto, hf = load_tokenizer(large_json), load_tokenizer(large_json, engine="hf")
    assert auto.vocab_size == 70_000 and auto.engine == "fastokens"
    texts = [" ".join(WORDS4[i::97]) for i in range(5)] + MULTILINGUAL
    flat, lengths = encode_documents(auto, texts)
    assert flat.dtype == np.int32 and flat.max() > 65_535
    assert (flat == auto.eos_id).sum() == len(texts)  # EOS placed, no id wrapped around
    assert flat.tolist() == encode_documents(hf, texts)[0].tolist()


def test_nfkc_normalizer_falls_back_and_stays_exact(nfkc_json):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = load_tokenizer(nfkc_json)
    assert tok.engine == "tokenizers"
    assert "NFKC" in tok.engine_notes[0] and tok.engine_notes[0].startswith("fastokens: ")
    assert "normalizer NFKC" in tok.engine_notes[1] and tok.engine_notes[1].startswith("tiktoken: ")
    assert len(caught) == 1 and "NFKC" in str(caught[0].message)
    ref = HFTok.from_file(nfkc_json)
    texts = sample_texts() + ["ﬁne ①②"]
    assert ids_of(tok, texts) == [ref.encode(t, add_special_tokens=False).ids for t in texts]
    assert ids_of(tok, ["ﬁne ①②"]) == ids_of(tok, ["fine 12"])  # NFKC was applied
    with pytest.raises(TokenizerError, match="engine 'fastokens' cannot run it.*NFKC"):
        load_tokenizer(nfkc_json, engine="fastokens")


def test_sentencepiece_model_runs_on_sentencepiece(tmp_path):
    import sentencepiece as spm

    lines = [line for t in training_texts() for line in t.splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                   vocab_size=800, minloglevel=2, byte_fallback=True)
    path = tmp_path / "sp.model"
    path.write_bytes(model.getvalue())
    tok = load_tokenizer(str(path))
    assert (tok.engine, tok.engine_notes) == ("sentencepiece", ())
    ref = spm.SentencePieceProcessor(model_file=str(path))
    texts = sample_texts()
    assert ids_of(tok, texts) == ref.encode(texts, out_type=int)
    assert load_tokenizer(str(path), engine="hf").engine == "sentencepiece"
    with pytest.raises(TokenizerError, match="runs on sentencepiece only"):
        load_tokenizer(str(path), engine="fastokens")


# ---- random text: every engine equals tokenizers --------------------------------------------

@pytest.fixture(scope="module")
def gpt2_engines(gpt2_json):
    return all_engines(gpt2_json)


@pytest.fixture(scope="module")
def llama3_engines(llama3_json):
    return all_engines(llama3_json)


def assert_engines_agree(engines: dict, texts: list[str]) -> list:
    """Every engine gives `tokenizers`' ids for ``texts``; those ids."""
    want = ids_of(engines["hf"], texts)
    for name, tok in engines.items():
        assert ids_of(tok, texts) == want, name
    return want


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(texts_strategy(), min_size=1, max_size=4))
def test_every_engine_equals_tokenizers_gpt2(gpt2_engines, texts):
    want = assert_engines_agree(gpt2_engines, texts)
    assert [gpt2_engines["fastokens"].decode(x) for x in want] == texts


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(texts_strategy(), min_size=1, max_size=4))
def test_every_engine_equals_tokenizers_llama3(llama3_engines, texts):
    assert_engines_agree(llama3_engines, texts)


def test_added_tokens_with_flags_are_proven_per_engine(gpt2_json, tmp_path):
    tok = HFTok.from_file(gpt2_json)
    tok.add_special_tokens([AddedToken("<tag>", lstrip=True, rstrip=True)])
    tok.add_tokens(["tag", "ag>"])  # overlapping added tokens
    tok.save(str(tmp_path / "tokenizer.json"))
    path = str(tmp_path / "tokenizer.json")
    auto = load_tokenizer(path)
    assert auto.engine == "fastokens"
    with pytest.raises(TokenizerError, match="lstrip"):
        load_tokenizer(path, engine="tiktoken")
    texts = ["a <tag> b", "a<tag>b", " <tag> ", "wordtag tag <tag>ag>"] + sample_texts()
    assert ids_of(auto, texts) == ids_of(load_tokenizer(path, engine="hf"), texts)


# ---- a mis-tokenizing engine is caught --------------------------------------------------------

def test_the_proof_catches_engines_that_disagree(dollar_json):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = load_tokenizer(dollar_json)
        load_tokenizer(dollar_json)
    assert tok.engine == "tokenizers" and len(caught) == 1  # warned once
    assert [n.split(":")[0] for n in tok.engine_notes] == ["fastokens", "tiktoken"]
    assert all("and tokenizers disagree on" in n for n in tok.engine_notes)
    ref = HFTok.from_file(dollar_json)
    texts = sample_texts() + ["x  \ny"]
    assert ids_of(tok, texts) == [ref.encode(t, add_special_tokens=False).ids for t in texts]
    for name in ("fastokens", "tiktoken"):
        with pytest.raises(TokenizerError, match=f"engine '{name}' cannot run it: .*disagree"):
            load_tokenizer(dollar_json, engine=name)


def test_a_wrong_id_on_one_word_is_caught(gpt2_json, monkeypatch):
    real = FastokensEngine.encode_batch

    def wrong_on_naive(self, texts):  # off by one on the last id of any text with "naïve"
        out = [x.copy() for x in real(self, texts)]
        for text, ids in zip(texts, out):
            if "naïve" in text:
                ids[-1] = (ids[-1] + 1) % 800
        return out

    monkeypatch.setattr(FastokensEngine, "encode_batch", wrong_on_naive)
    tok = load_tokenizer(gpt2_json)
    assert tok.engine == "tiktoken"
    assert len(tok.engine_notes) == 1 and "fastokens and tokenizers disagree on" in \
        tok.engine_notes[0] and "naïve" in tok.engine_notes[0]
    assert ids_of(tok, ["a naïve café"]) == ids_of(load_tokenizer(gpt2_json, engine="hf"),
                                                  ["a naïve café"])


def test_fastokens_missing_or_input_cache_set_is_refused(gpt2_json, monkeypatch):
    monkeypatch.setenv("FASTOKENS_INPUT_CACHE", "64")
    tok = load_tokenizer(gpt2_json)
    assert tok.engine == "tiktoken" and "FASTOKENS_INPUT_CACHE is set" in tok.engine_notes[0]
    monkeypatch.delenv("FASTOKENS_INPUT_CACHE")
    monkeypatch.setitem(sys.modules, "fastokens", None)  # import fastokens -> ImportError
    tok = load_tokenizer(gpt2_json)
    assert tok.engine == "tiktoken"
    assert tok.engine_notes == ("fastokens: not installed (pip install 'tokenmill[fast]')",)


def test_proof_sample_covers_what_it_says():
    sample = proof_sample(["<|endoftext|>", "<s>"])
    joined = "".join(sample)
    assert sample[:len(PROOF_SAMPLE)] == list(PROOF_SAMPLE) and sample == proof_sample(
        ["<s>", "<|endoftext|>"])  # deterministic, order of added tokens irrelevant
    assert max(map(len, sample)) > 100_000 and " " * 5000 in joined and "😀" * 600 in joined
    assert "x<s>y <s> <s><s>" in joined and "<|endoftext|><s>" not in PROOF_SAMPLE
    for script in ("日本語", "Привет", "مرحبا", "नमस्ते", "👨‍👩‍👧", "1234567890", "\t\t"):
        assert script in joined


# ---- choosing by name; workers; the store ---------------------------------------------------

def test_engine_names_and_the_older_fast_flag(gpt2_json):
    assert load_tokenizer(gpt2_json, fast=False).engine == "tokenizers"
    assert load_tokenizer(gpt2_json, fast="tiktoken").engine == "tiktoken"
    assert load_tokenizer(gpt2_json, engine="tokenizers").engine == "tokenizers"
    assert load_tokenizer(gpt2_json, engine="tiktoken").engine_notes == \
        ("asked for: engine='tiktoken'",)
    with pytest.raises(ConfigError, match="one of auto, fastokens, tiktoken, hf.*'fast'"):
        load_tokenizer(gpt2_json, engine="fast")
    assert load_tokenizer("bytes", engine="hf").engine == "bytes"
    with pytest.raises(TokenizerError, match="runs on bytes only"):
        load_tokenizer("bytes", engine="tiktoken")


WORKER = """
import pickle, sys
tok = pickle.loads(sys.stdin.buffer.read())
print(tok.engine, tok.engine_notes, [x.tolist() for x in tok.encode_batch(["naïve café x  y"])])
"""


@pytest.mark.parametrize("engine", ["auto", "tiktoken"])
def test_a_pickled_tokenizer_runs_its_engine_in_another_process(gpt2_json, engine):
    tok = load_tokenizer(gpt2_json, engine=engine)
    out = subprocess.run([sys.executable, "-c", WORKER], input=pickle.dumps(tok),
                         capture_output=True, check=True).stdout.decode()
    ids = [x.tolist() for x in tok.encode_batch(["naïve café x  y"])]
    assert out.strip() == f"{tok.engine} {tok.engine_notes} {ids}"


def test_the_store_is_the_same_whichever_engine_runs(gpt2_json, tmp_path):
    from tokenmill.cli import main

    texts = [t for t in sample_texts() if t] * 3  # an empty line is no document
    write_jsonl(tmp_path / "in.jsonl", texts)
    stores = {}
    for engine, workers in zip(ENGINES, ["2", "1", "1"]):
        out = tmp_path / engine
        assert main(["prepare", str(tmp_path / "in.jsonl"), "--out", str(out), "--tokenizer",
                     gpt2_json, "--tokenizer-engine", engine, "--workers", workers,
                     "--quiet"]) == 0
        stores[engine] = store_bytes(out)
    manifests = {e: json.loads(files.pop("manifest.json")) for e, files in stores.items()}
    assert stores["fastokens"] == stores["tiktoken"] == stores["hf"]  # every shard, byte for byte
    same = ("fingerprint", "tokenizer", "shards", "num_tokens", "num_documents", "settings")
    assert len({json.dumps([m.get(k) for k in same]) for m in manifests.values()}) == 1
    manifest = manifests["hf"]
    flat, _ = encode_documents(load_tokenizer(gpt2_json, engine="hf"), texts)
    assert (manifest["num_documents"], manifest["num_tokens"]) == (len(texts), len(flat))

"""The tiktoken fast path: engaged and equal to tokenizers on real and random text, or refused."""

import json
import warnings

import pytest
from hypothesis import given, settings, strategies as st
from test_tokenizer import (  # noqa: F401  (gpt2_json, llama3_json: fixtures)
    FRAGMENTS, edited, gpt2_json, ids_of, llama3_json, training_texts,
)
from tokenizers import Regex, Tokenizer as HFTok, models, normalizers
from tokenizers import pre_tokenizers, trainers

from tokenmill.fastbpe import _PROOF_SAMPLE
from tokenmill.tokenizer import load_tokenizer


def texts_strategy():
    piece = st.one_of(st.text(max_size=12), st.sampled_from(FRAGMENTS),
                      st.text(alphabet=" \t\n\r'sSdl0123456789aA.,", max_size=12))
    return st.lists(piece, max_size=12).map("".join)


# ---- Hugging Face: fast path ------------------------------------------------------------------

@pytest.mark.parametrize("which", ["gpt2_json", "llama3_json"])
def test_fast_path_engaged_and_equal_on_real_text(which, request):
    path = request.getfixturevalue(which)
    fast, slow = load_tokenizer(path), load_tokenizer(path, fast=False)
    assert (fast.engine, fast.fallback_reason) == ("tiktoken", None)
    assert slow.engine == "tokenizers" and fast.kind == slow.kind == "hf"
    texts = training_texts() + list(_PROOF_SAMPLE) + FRAGMENTS
    assert ids_of(fast, texts) == ids_of(slow, texts)
    assert fast.identity() == slow.identity()  # the store must not depend on the engine
    assert fast.decode(fast.encode_batch([texts[0]])[0]) == texts[0]


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(texts_strategy(), min_size=1, max_size=4))
def test_fast_path_equals_tokenizers_gpt2(gpt2_json, texts):
    fast, slow = load_tokenizer(gpt2_json), load_tokenizer(gpt2_json, fast=False)
    assert ids_of(fast, texts) == ids_of(slow, texts)
    assert [fast.decode(x) for x in fast.encode_batch(texts)] == texts


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(texts_strategy(), min_size=1, max_size=4))
def test_fast_path_equals_tokenizers_llama3(llama3_json, texts):
    fast, slow = load_tokenizer(llama3_json), load_tokenizer(llama3_json, fast=False)
    assert ids_of(fast, texts) == ids_of(slow, texts)


def test_special_token_text_becomes_the_added_token(gpt2_json):
    tok = load_tokenizer(gpt2_json)
    ids = tok.encode_batch(["a<|endoftext|>b"])[0].tolist()
    assert tok.eos_id in ids and ids == ids_of(load_tokenizer(gpt2_json, fast=False),
                                               ["a<|endoftext|>b"])[0]


def test_fast_path_maps_ids_when_they_do_not_follow_merge_order(gpt2_json, tmp_path):
    def shuffle_ids(config):  # reverse the ids of the merged tokens: same BPE, other ids
        vocab = config["model"]["vocab"]
        merged = sorted((i, t) for t, i in vocab.items() if i >= 257)
        for (i, t), (j, _) in zip(merged, reversed(merged)):
            vocab[t] = j
    path = edited(gpt2_json, tmp_path / "tokenizer.json", shuffle_ids)
    fast, slow = load_tokenizer(path), load_tokenizer(path, fast=False)
    assert fast.engine == "tiktoken" and fast._lut is not None
    texts = training_texts()[:3] + ["x<|endoftext|>y"]
    assert ids_of(fast, texts) == ids_of(slow, texts)
    assert ids_of(fast, texts) != ids_of(load_tokenizer(gpt2_json), texts)


# ---- Hugging Face: where the fast path must refuse -------------------------------------------

def load_warns(path, match):
    """Load twice; exactly one warning, matching `match`; the tokenizer falls back."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = load_tokenizer(path)
        load_tokenizer(path)
    assert len(caught) == 1 and match in str(caught[0].message), [str(w.message) for w in caught]
    assert tok.engine == "tokenizers" and match in tok.fallback_reason
    return tok


def test_refuses_normalizer(gpt2_json, tmp_path):
    def lowercase(config):
        config["normalizer"] = json.loads(normalizers.Lowercase().__getstate__())
    path = edited(gpt2_json, tmp_path / "lower.json", lowercase)
    tok = load_warns(path, "normalizer Lowercase")
    assert ids_of(tok, ["ABC def"]) == ids_of(tok, ["abc def"])


def test_refuses_wordpiece(tmp_path):
    tok = HFTok(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(training_texts(), trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[UNK]", "</s>"], show_progress=False))
    tok.save(str(tmp_path / "wp.json"))
    tok = load_warns(str(tmp_path / "wp.json"), "model is WordPiece")
    assert tok.eos_id == 1


def test_refuses_when_the_proof_fails(tmp_path):
    # Oniguruma's `$` is end of line, fancy-regex's end of text: "x  \ny" splits differently
    pattern = r"\s+$|\s|\p{L}+|\p{N}+|[^\s\p{L}\p{N}]+"
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.train_from_iterator(training_texts(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    tok = load_warns(str(tmp_path / "tokenizer.json"), "disagree")
    assert ids_of(tok, ["x  \ny"]) == ids_of(load_tokenizer(str(tmp_path / "tokenizer.json"),
                                                            fast=False), ["x  \ny"])


def test_refuses_prefix_space_and_stripping_added_tokens(gpt2_json, tmp_path):
    def prefix_space(config):
        config["pre_tokenizer"]["add_prefix_space"] = True
    load_warns(edited(gpt2_json, tmp_path / "a.json", prefix_space), "pre-tokenizer")

    def lstrip(config):
        config["added_tokens"][0]["lstrip"] = True
    load_warns(edited(gpt2_json, tmp_path / "b.json", lstrip), "lstrip")

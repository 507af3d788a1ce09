"""Tokenizers as users name them (issue 17): tiktoken encoding names read from tiktoken's own cache,
Hugging Face Hub ids read from huggingface_hub's cache (offline), files recognised by their content,
the EOS named by tokenizer_config.json / generation_config.json, and the manifest recording the
resolved file. Every cache here is built by the test; nothing touches the network."""

import base64
import hashlib
import io
import itertools
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import tiktoken.load
import tiktoken.registry
import xxhash

from conftest import MULTILINGUAL, edited, ids_of, training_texts, write_jsonl
from tokenmill import load_tokenizer, prepare
from tokenmill.base.errors import TokenizerError
from tokenmill.tokenizer.fastbpe import _bytes_to_unicode
from tokenmill.store import TokenStore
from tokenmill.tokenizer.files import sniff

TEXTS = training_texts()[:6] + MULTILINGUAL + ["", "don't 1234567 3.14  \n\n\t😀"]
BLOB = "https://openaipublic.blob.core.windows.net/"
TOKENMILL = Path(sys.executable).with_name("tokenmill")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No network, and tiktoken's registry forgets encodings built by other tests."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("cl100k_base", "gpt2", "o200k_base", "r50k_base"):
        monkeypatch.delitem(tiktoken.registry.ENCODINGS, name, raising=False)
    yield
    for name in ("cl100k_base", "gpt2", "o200k_base", "r50k_base"):
        tiktoken.registry.ENCODINGS.pop(name, None)


def ranks_of(hf_json: str) -> dict[bytes, int]:
    """A trained byte-level BPE's tokens as tiktoken ranks (bytes → id; the special dropped)."""
    config = json.loads(Path(hf_json).read_text(encoding="utf-8"))
    decode = {c: b for b, c in _bytes_to_unicode().items()}
    added = {t["content"] for t in config["added_tokens"]}
    return {bytes(decode[c] for c in t): i for t, i in config["model"]["vocab"].items()
            if t not in added}


def tiktoken_text(ranks: dict[bytes, int]) -> bytes:
    """The .tiktoken format: base64 token, space, rank per line."""
    return b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items())


def cache(folder: Path, url: str, data: bytes) -> Path:
    """Put ``data`` where tiktoken caches ``url``: <folder>/sha1(url)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / hashlib.sha1(url.encode()).hexdigest()
    path.write_bytes(data)
    return path


def hub_repo(hub: Path, repo: str, files: dict[str, bytes], *, commit: str = "a" * 40,
             ref: str | None = "main") -> Path:
    """A model in huggingface_hub's cache layout: blobs/<sha256>, snapshots/<commit>/<name> (a
    symlink to its blob, as the library makes it) and refs/<ref> holding the commit."""
    root = hub / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (root / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).unlink(missing_ok=True)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    if ref:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snap


def sentencepiece_model() -> bytes:
    """A small sentencepiece model trained on real text (vocab 200)."""
    import sentencepiece as spm
    lines = [line for t in training_texts() for line in t.splitlines() if line.strip()]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=out,
                                   vocab_size=200, minloglevel=2)
    return out.getvalue()


# ---- tiktoken names ---------------------------------------------------------------------------

def test_cl100k_name_reads_tiktokens_cache_and_encodes_like_tiktoken(gpt2_json, tmp_path,
                                                                    monkeypatch):
    ranks = ranks_of(gpt2_json)
    data = tiktoken_text(ranks)
    path = cache(tmp_path / "tt", BLOB + "encodings/cl100k_base.tiktoken", data)
    cache(tmp_path / "tt", BLOB + "encodings/o200k_base.tiktoken", data)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tt"))
    # the blob is ours, not OpenAI's: both tiktoken and tokenmill check its sha256; accept it
    monkeypatch.setattr(tiktoken.load, "check_hash", lambda data, expected: True)
    tok = load_tokenizer("cl100k_base")
    ref = tiktoken.get_encoding("cl100k_base")  # tiktoken's own object, on the same cache
    assert ids_of(tok, TEXTS) == [ref.encode_ordinary(t) for t in TEXTS]
    assert (tok.kind, tok.engine, tok.vocab_size, tok.eos_id) == ("tiktoken", "tiktoken",
                                                                   ref.n_vocab, ref.eot_token)
    assert (tok.eos_id, tok.vocab_size) == (100257, 100277)  # OpenAI's special ids
    identity = tok.identity()
    assert identity == {"kind": "tiktoken", "name": "cl100k_base", "vocab_size": 100277,
                        "eos_id": 100257, "bos_id": None, "spec": "cl100k_base",
                        "file_xxh3": xxhash.xxh3_64_hexdigest(data)}
    assert tok.source == f"tiktoken:cl100k_base ({path.name})"
    # the same bytes as a local file give the same ids and file hash (the spec is the difference)
    local = tmp_path / "cl100k_base.tiktoken"
    local.write_bytes(data)
    as_file = load_tokenizer(str(local))
    assert ids_of(as_file, TEXTS) == ids_of(tok, TEXTS)
    assert as_file.identity()["file_xxh3"] == identity["file_xxh3"]
    assert "spec" not in as_file.identity()
    back = pickle.loads(pickle.dumps(tok))  # a worker re-resolves the name, to the same file
    assert back.identity() == identity and ids_of(back, TEXTS[:3]) == ids_of(tok, TEXTS[:3])
    o200k = load_tokenizer("o200k_base")  # o200k's own regex and special ids on the same ranks
    assert ids_of(o200k, TEXTS) == [tiktoken.get_encoding("o200k_base").encode_ordinary(t)
                                    for t in TEXTS]
    assert (o200k.eos_id, o200k.identity()["spec"]) == (199999, "o200k_base")


def test_gpt2_name_is_tiktokens_gpt2_from_its_two_cached_files(tmp_path, monkeypatch):
    # tiktoken's gpt2 is vocab.bpe (merges) + encoder.json, exactly 50,257 ids: 256 bytes,
    # 50,000 merges (here: pairs of bytes) and <|endoftext|> = 50256
    byte_char = _bytes_to_unicode()
    merges = list(itertools.islice(itertools.product(range(256), range(256)), 50_000))
    order = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    order += [b for b in range(256) if b not in order]  # tiktoken's data_gym rank order
    encoder = {byte_char[b]: i for i, b in enumerate(order)}
    encoder.update({byte_char[a] + byte_char[b]: 256 + i for i, (a, b) in enumerate(merges)})
    encoder["<|endoftext|>"] = 50256
    vocab = "#version: 0.2\n" + "".join(f"{byte_char[a]} {byte_char[b]}\n" for a, b in merges)
    tt = tmp_path / "tt"
    cache(tt, BLOB + "gpt-2/encodings/main/vocab.bpe", vocab.encode())
    cache(tt, BLOB + "gpt-2/encodings/main/encoder.json", json.dumps(encoder).encode())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tt))
    monkeypatch.setattr(tiktoken.load, "check_hash", lambda data, expected: True)
    tok = load_tokenizer("gpt2")
    ref = tiktoken.get_encoding("gpt2")
    assert ids_of(tok, TEXTS) == [ref.encode_ordinary(t) for t in TEXTS]
    assert (tok.vocab_size, tok.eos_id, tok.decode([50256])) == (50257, 50256, "<|endoftext|>")
    assert tok.identity()["spec"] == "gpt2"
    # r50k_base: the same 50,256 ranks in one .tiktoken file
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(  # reads them from the cache above
        BLOB + "gpt-2/encodings/main/vocab.bpe", BLOB + "gpt-2/encodings/main/encoder.json")
    cache(tt, BLOB + "encodings/r50k_base.tiktoken", tiktoken_text(ranks))
    r50k = load_tokenizer("r50k_base")
    assert ids_of(r50k, TEXTS) == ids_of(tok, TEXTS) == [
        tiktoken.get_encoding("r50k_base").encode_ordinary(t) for t in TEXTS]


def test_a_missing_or_altered_tiktoken_blob_says_how_to_get_it(gpt2_json, tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    want = tmp_path / "empty" / hashlib.sha1(
        (BLOB + "encodings/o200k_base.tiktoken").encode()).hexdigest()
    with pytest.raises(TokenizerError) as e:
        load_tokenizer("o200k_base")
    message = str(e.value)
    assert "not in tiktoken's cache" in message and str(want) in message
    assert "tiktoken.get_encoding('o200k_base')" in message and "TIKTOKEN_CACHE_DIR" in message
    cache(tmp_path / "tt", BLOB + "encodings/cl100k_base.tiktoken",
          tiktoken_text(ranks_of(gpt2_json)))  # not OpenAI's bytes: its sha256 differs
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tt"))
    with pytest.raises(TokenizerError, match="is not the file tiktoken expects .* delete it"):
        load_tokenizer("cl100k_base")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    with pytest.raises(TokenizerError, match="turns tiktoken's cache off"):
        load_tokenizer("cl100k_base")


# ---- Hugging Face Hub ids ---------------------------------------------------------------------

def test_hub_id_resolves_offline_from_the_cache(gpt2_json, llama3_json, tmp_path, monkeypatch):
    hub = tmp_path / "home" / "hub"
    hub_repo(hub, "org/name", {"tokenizer.json": Path(gpt2_json).read_bytes(),
                               "config.json": b"{}"})
    other = "b" * 40
    hub_repo(hub, "org/name", {"tokenizer.json": Path(llama3_json).read_bytes()}, commit=other,
             ref="v2")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    tok = load_tokenizer("org/name")
    assert ids_of(tok, TEXTS) == ids_of(load_tokenizer(gpt2_json), TEXTS)
    assert tok.identity() == {**load_tokenizer(gpt2_json).identity(), "spec": "org/name"}
    assert tok.source == f"hf:org/name@{'a' * 40}/tokenizer.json"
    for spec in (f"org/name@{other}", "org/name@v2"):  # a commit, a tag
        at = load_tokenizer(spec)
        assert ids_of(at, TEXTS) == ids_of(load_tokenizer(llama3_json), TEXTS)
        assert at.identity()["spec"] == spec and at.source.startswith(f"hf:org/name@{other}")
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))  # the other way to say where the cache is
    assert load_tokenizer("org/name").identity()["file_xxh3"] == tok.identity()["file_xxh3"]
    back = pickle.loads(pickle.dumps(tok))
    assert back.identity()["file_xxh3"] == tok.identity()["file_xxh3"]


def test_a_hub_id_not_cached_offline_says_what_was_tried(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(TokenizerError) as e:
        load_tokenizer("meta-llama/Llama-3.2-1B")
    message = str(e.value)
    assert message.startswith("tokenizer 'meta-llama/Llama-3.2-1B': no such file or folder here, "
                              f"and not found in the Hugging Face cache {tmp_path / 'hub'} (no "
                              "snapshot of revision main there)")
    assert "HF_HUB_OFFLINE is set" in message and "hf download meta-llama/Llama-3.2-1B" in message
    hub_repo(tmp_path / "hub", "org/weights", {"model.safetensors": b"\0" * 64,
                                               "config.json": b"{}"})
    with pytest.raises(TokenizerError, match="holds no tokenizer file"):
        load_tokenizer("org/weights")


def test_unknown_names_list_what_was_tried(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TokenizerError) as e:
        load_tokenizer("cl100k")
    message = str(e.value)
    assert "unknown tokenizer spec 'cl100k': not a file or folder here, not a tiktoken" in message
    assert "cl100k_base" in message and "o200k_base" in message and "org/name" in message
    with pytest.raises(TokenizerError, match="tokenizer file not found: 'org/tok.json'"):
        load_tokenizer("org/tok.json")  # a file's name is not looked up on the Hub


def test_without_huggingface_hub_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import raises ImportError
    with pytest.raises(TokenizerError, match=r"needs huggingface_hub: pip install 'tokenmill\[hf\]'"):
        load_tokenizer("org/name")


# ---- files recognised by content --------------------------------------------------------------

def test_files_are_recognised_by_content_not_name(gpt2_json, tmp_path, monkeypatch):
    model = sentencepiece_model()
    assert sniff(model[:256]) == "sentencepiece"
    assert sniff(b"Hello 1\nworld\n") is None and sniff(b"IQ== 0\nIg== 1\nIw") == "tiktoken"
    snap = hub_repo(tmp_path / "hub", "mistralai/Tiny", {"tokenizer.model.v3": model,
                                                         "params.json": b'{"dim": 8}'})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import sentencepiece as spm
    ref = spm.SentencePieceProcessor(model_proto=model)
    for spec in ("mistralai/Tiny", str(snap / "tokenizer.model.v3"), str(snap)):
        tok = load_tokenizer(spec)
        assert (tok.kind, tok.name, tok.eos_id) == ("sentencepiece", "tokenizer.model.v3", 2)
        assert ids_of(tok, MULTILINGUAL) == ref.encode(MULTILINGUAL, out_type=int)
    # a tokenizer.json under another name; tiktoken ranks in a .model file (as Llama 3 ships them)
    shutil.copy(gpt2_json, tmp_path / "vocab-v1.txt")
    assert load_tokenizer(str(tmp_path / "vocab-v1.txt")).kind == "hf"
    (tmp_path / "tokenizer.model").write_bytes(tiktoken_text(ranks_of(gpt2_json)))
    assert load_tokenizer(str(tmp_path / "tokenizer.model")).kind == "tiktoken"
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(TokenizerError, match="notes.txt: not a tokenizer file"):
        load_tokenizer(str(tmp_path / "notes.txt"))


# ---- EOS named beside a tokenizer.json --------------------------------------------------------

def deepseek_like(gpt2_json: str, folder: Path) -> str:
    """gpt2_json with its one special token renamed to DeepSeek's EOS: no known EOS name."""
    folder.mkdir(parents=True, exist_ok=True)

    def rename(config):
        config["added_tokens"][0]["content"] = "<｜end▁of▁sentence｜>"
        vocab = config["model"]["vocab"]
        vocab["<｜end▁of▁sentence｜>"] = vocab.pop("<|endoftext|>")
    return edited(gpt2_json, folder / "tokenizer.json", rename)


def test_eos_from_tokenizer_config_or_generation_config(gpt2_json, tmp_path):
    path = deepseek_like(gpt2_json, tmp_path / "ds")
    with pytest.raises(TokenizerError, match="has no EOS token"):
        load_tokenizer(path)
    config = tmp_path / "ds" / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": {"__type": "AddedToken",
                                                "content": "<｜end▁of▁sentence｜>"},
                                  "bos_token": None}))
    tok = load_tokenizer(path)
    assert (tok.eos_id, tok.bos_id) == (0, None)
    assert tok.identity()["eos_from"] == "tokenizer_config.json"
    assert load_tokenizer(str(tmp_path / "ds")).eos_id == 0  # the folder itself
    assert load_tokenizer(path, eos="a").eos_id != 0 and "eos_from" not in load_tokenizer(
        path, eos="a").identity()  # an explicit eos= wins
    config.unlink()
    (tmp_path / "ds" / "generation_config.json").write_text('{"eos_token_id": [0, 7]}')
    assert load_tokenizer(path).identity()["eos_from"] == "generation_config.json"
    assert load_tokenizer(path).eos_id == 0
    # a tokenizer.json that names its EOS keeps it, whatever a config beside it says
    (tmp_path / "g").mkdir()
    shutil.copy(gpt2_json, tmp_path / "g" / "tokenizer.json")
    (tmp_path / "g" / "tokenizer_config.json").write_text('{"eos_token": "a"}')
    assert load_tokenizer(str(tmp_path / "g" / "tokenizer.json")).identity() == \
        load_tokenizer(gpt2_json).identity()


# ---- the store records the resolved file ------------------------------------------------------

def test_a_resume_whose_name_resolves_to_another_file_is_refused(gpt2_json, llama3_json, tmp_path,
                                                                  monkeypatch):
    hub = tmp_path / "hub"
    hub_repo(hub, "org/name", {"tokenizer.json": Path(gpt2_json).read_bytes()})
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    write_jsonl(tmp_path / "in.jsonl", TEXTS)
    manifest = prepare(tmp_path / "in.jsonl", out=tmp_path / "s", tokenizer="org/name", workers=1,
                       progress=False)
    want = xxhash.xxh3_64_hexdigest(Path(gpt2_json).read_bytes())
    assert manifest["tokenizer"]["spec"] == "org/name"
    assert manifest["tokenizer"]["file_xxh3"] == manifest["settings"]["tokenizer_file_xxh3"] == want
    assert manifest["tokenizer_engine"]["source"] == f"hf:org/name@{'a' * 40}/tokenizer.json"
    again = prepare(tmp_path / "in.jsonl", out=tmp_path / "s", tokenizer="org/name", workers=1,
                    progress=False)
    assert again == manifest  # the same file behind the name: already complete
    hub_repo(hub, "org/name", {"tokenizer.json": Path(llama3_json).read_bytes()},
             commit="c" * 40)  # refs/main moves to a commit with another tokenizer
    with pytest.raises(Exception, match="other settings .*tokenizer_file_xxh3"):
        prepare(tmp_path / "in.jsonl", out=tmp_path / "s", tokenizer="org/name", workers=1,
                progress=False)


def test_cli_prepare_with_a_hub_id(gpt2_json, tmp_path):
    home = tmp_path / "home"
    deepseek = Path(deepseek_like(gpt2_json, tmp_path / "src"))
    hub_repo(home / "hub", "org/name", {
        "tokenizer.json": deepseek.read_bytes(),
        "tokenizer_config.json": b'{"eos_token": "<\\uff5cend\\u2581of\\u2581sentence\\uff5c>"}'})
    write_jsonl(tmp_path / "in.jsonl", TEXTS)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "TIKTOKEN_CACHE_DIR")}
    r = subprocess.run([str(TOKENMILL), "prepare", "in.jsonl", "--out", "s", "--tokenizer",
                        "org/name", "--workers", "2"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env={**env, "HF_HOME": str(home),
                                                    "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    assert f"tokenizer org/name: hf:org/name@{'a' * 40}/tokenizer.json" in r.stderr + r.stdout
    store = TokenStore(tmp_path / "s")
    ref = load_tokenizer(str(deepseek), eos="<｜end▁of▁sentence｜>")
    kept = [t for t in TEXTS if t]  # prepare skips empty documents
    want = [ids + [0] for ids in ids_of(ref, kept)]  # EOS (id 0) from tokenizer_config.json
    assert [np.asarray(store[i]).tolist() for i in range(len(store))] == want
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["tokenizer"]["spec"] == "org/name"
    assert manifest["tokenizer"]["eos_from"] == "tokenizer_config.json"
    r = subprocess.run([str(TOKENMILL), "prepare", "in.jsonl", "--out", "s2", "--tokenizer",
                        "org/missing"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**env, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"})
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.startswith("tokenmill prepare: error: tokenizer 'org/missing': no such file "
                               "or folder here, and not found in the Hugging Face cache")


def test_a_gated_model_gets_the_hubs_own_words(tmp_path, monkeypatch):
    import httpx2
    import huggingface_hub
    from huggingface_hub import constants, errors

    words = ("401 Client Error. Cannot access gated repo for url https://huggingface.co/api/"
             "models/meta-llama/Llama-3.2-1B. Access to model meta-llama/Llama-3.2-1B is "
             "restricted. You must have access to it and be authenticated to access it.")
    calls = []

    def snapshot_download(repo_id, *, local_files_only=False, **kwargs):
        """The Hub as a user without access sees it: nothing cached, a gated repo online."""
        calls.append(local_files_only)
        if local_files_only:
            raise errors.LocalEntryNotFoundError("no cached snapshot")
        raise errors.GatedRepoError(words, response=httpx2.Response(
            401, request=httpx2.Request("GET", "https://huggingface.co")))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(TokenizerError) as e:
        load_tokenizer("meta-llama/Llama-3.2-1B")
    assert calls == [True, False]  # the cache first, then the Hub
    assert str(e.value) == f"tokenizer 'meta-llama/Llama-3.2-1B': the Hub says: {words}"

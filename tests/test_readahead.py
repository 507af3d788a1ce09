"""prepare's inline path reads ahead in a thread; JSONL lines parse from bytes (orjson if present)."""

import json

import pytest

from conftest import docs_of, write_jsonl
from tokenmill.inputs import jsonl, sources
from tokenmill.base.errors import InputError
from tokenmill.prepare import PrepareConfig, prepare, tokenize_unit
from tokenmill.prepare.pool import ReadAhead, inline_results
from tokenmill.tokenizer import load_tokenizer

TEXTS = [f"document {i:04d} " + "word " * (i % 37) for i in range(400)]


def small_units(path, unit_bytes=2_000):
    """A config cutting `path` into many small units, and those units."""
    config = PrepareConfig(unit_bytes=unit_bytes)
    return config, sources.plan_units([str(path)], config.source_config())


def test_inline_results_equal_unit_by_unit_tokenizing(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    config, units = small_units(path)
    assert len(units) > 10
    tok = load_tokenizer("bytes")
    got = list(inline_results(units, 3, config, None, tok, None))
    assert [u for u, _ in got] == list(range(3, len(units)))
    for u, res in got:
        want = tokenize_unit(units[u], config, tokenizer=tok)
        assert res.tokens.tolist() == want.tokens.tolist()
        assert res.lengths.tolist() == want.lengths.tolist() and res.digest == want.digest


def test_a_read_error_is_raised_at_its_unit_after_the_units_before_it(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = [json.dumps({"text": t}) for t in TEXTS]
    lines[300] = '{"text": broken'
    path.write_text("\n".join(lines) + "\n")
    config, units = small_units(path)
    bad = next(u for u, unit in enumerate(units) if unit.start <= sum(
        len(x) + 1 for x in lines[:300]) < unit.stop)
    seen = []
    with pytest.raises(InputError, match=r"a\.jsonl:301: malformed JSON"):
        for u, _ in inline_results(units, 0, config, None, load_tokenizer("bytes"), None):
            seen.append(u)
    assert seen == list(range(bad))


def test_a_read_ahead_of_other_units_is_dropped_not_used(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    config, units = small_units(path)
    stale = ReadAhead(units[:2], config)  # e.g. started before a resume moved the first unit
    tok = load_tokenizer("bytes")
    got = [res.lengths.tolist() for _, res in inline_results(units, 0, config, None, tok, None,
                                                             stale)]
    assert got == [tokenize_unit(x, config, tokenizer=tok).lengths.tolist() for x in units]
    assert not stale.reads(units[:2]) and not stale.thread.is_alive()


def test_prepare_inline_store_equals_the_texts(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    prepare(str(path), out=tmp_path / "s", workers=1, unit_bytes=2_000, progress=False)
    assert docs_of(tmp_path / "s") == [list(t.encode()) + [256] for t in TEXTS]


TRICKY = [b'{"text": "plain"}', b'{"text": "lone \\ud800 surrogate"}', b'{"text": NaN}',
          b'{"text": 123456789012345678901234567890}', b'{"text": ""}', b'{"text": "crlf"}\r',
          b'{"text": "a", "text": "named twice"}', b'{"text": "bad \xff utf8"}', b"",
          b'{"text": "\\ud83d\\ude00 pair"}', b'{"n": 1e400, "text": "inf beside"}',
          b'{"text": "tab\tinside"}', b'[1, 2]', b'{"other": "no text"}', b'{"text": "end"}']


@pytest.mark.parametrize("fast", [True, False])
def test_jsonl_lines_parse_as_the_stdlib_parses_them(tmp_path, monkeypatch, fast):
    if fast:
        import orjson  # noqa: F401  (the `fast` extra: make test installs it)
        assert jsonl._loads_bytes is not jsonl._stdlib_loads_bytes
    else:
        monkeypatch.setattr(jsonl, "_loads_bytes", jsonl._stdlib_loads_bytes)
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(TRICKY) + b"\n")
    config = PrepareConfig(on_error="skip").source_config()
    got = [x.text if isinstance(x, sources.Doc) else (x.where, x.reason)
           for unit in sources.plan_units([str(path)], config)
           for x in sources.read_unit(unit, config)]
    assert got == ["plain", "lone \ud800 surrogate",
                   ("line 3", "non_string_field"), ("line 4", "non_string_field"),
                   ("line 5", "empty_document"), "crlf", ("line 7", "malformed_json"),
                   ("line 8", "invalid_utf8"), "\U0001F600 pair", "inf beside",
                   ("line 12", "malformed_json"), ("line 13", "malformed_json"),
                   ("line 14", "missing_field"), "end"]


def test_inputs_given_as_a_generator_are_all_prepared(tmp_path):
    paths = [write_jsonl(tmp_path / f"{i}.jsonl", TEXTS[i::2]) for i in range(2)]
    prepare((str(p) for p in paths), out=tmp_path / "s", workers=1, progress=False)
    assert len(docs_of(tmp_path / "s")) == len(TEXTS)
    both = prepare((str(p) for p in paths), out=tmp_path / "split", workers=1, progress=False,
                   val_fraction=0.3)  # two passes over the inputs
    assert sum(m["num_documents"] for m in both.values()) == len(TEXTS)


def test_a_compressed_input_is_planned_once(tmp_path, monkeypatch):
    """Planning a .jsonl.gz decompresses it whole: the early reader (which does not take
    compressed inputs) must not plan it before start_run does."""
    import gzip
    from tokenmill.inputs import readers
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in TEXTS)
    calls = []
    plan = readers.plan_compressed
    monkeypatch.setattr(readers, "plan_compressed", lambda *a: calls.append(a) or plan(*a))
    prepare(str(tmp_path / "a.jsonl.gz"), out=str(tmp_path / "s"), workers=1, progress=False)
    assert len(calls) == 1
    assert [bytes(d[:-1]).decode() for d in docs_of(tmp_path / "s")] == TEXTS

"""Inputs as a user meets them (issue 26): a folder of documentation read with --text-ext, one
document per file; several JSON fields joined by --text-key a,b; what a walk passed over and a
missing field say. Real files, `tokenmill prepare` processes, the store's exact documents."""

import json

import pytest

from conftest import byte_texts, run_prepare

DOCS = {  # a documentation folder as people have them
    "README": "tokenmill\n=========\n\nKeeps accelerators fed.\n",
    "guide/index.md": "# Guide\n\nStart here: `pip install tokenmill`.\n",
    "guide/api.rst": "API\n---\n\n.. function:: prepare(inputs)\n",
    "site/page.HTML": "<html><body><p>Héllo, wörld</p></body></html>\n",
    "notes.txt": "a plain text note\n",
    "logo.png": "\x89PNG not text",
}


@pytest.fixture
def docs(tmp_path):
    for name, text in DOCS.items():
        (tmp_path / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "docs" / name).write_text(text, encoding="utf-8")
    return tmp_path / "docs"


def test_a_documentation_folder_prepares_with_text_ext_one_document_per_file(tmp_path, docs):
    r = run_prepare(tmp_path, "docs", "--out", "plain")
    assert r.returncode == 0, r.stderr
    assert byte_texts(tmp_path / "plain") == [DOCS["notes.txt"]]
    note = next(line for line in r.stderr.splitlines() if line.startswith("note: ignored"))
    assert note.startswith("note: ignored 5 files: 1 (no extension), 1 .html, 1 .md, 1 .png, "
                           "1 .rst (e.g. docs/README, docs/guide/api.rst, docs/guide/index.md)")
    assert note.endswith("--text-ext html,md,png,rst,'' reads them as plain text (text_ext= in Python)")

    r = run_prepare(tmp_path, "docs", "--out", "store", "--text-ext", "md,.RST,html,''")
    assert r.returncode == 0, r.stderr
    assert "ignored 1 file: 1 .png (e.g. docs/logo.png)" in r.stderr  # still said, not silent
    want = sorted(["README", "guide/api.rst", "guide/index.md", "notes.txt", "site/page.HTML"])
    assert byte_texts(tmp_path / "store") == [DOCS[n] for n in want]  # in path order, each whole
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["settings"]["text_ext"] == [".md", ".rst", ".html", ""]
    again = run_prepare(tmp_path, "docs", "--out", "store", "--text-ext", "md,.RST,html,''")
    assert again.returncode == 0 and "other settings" not in again.stderr, again.stderr
    assert json.loads((tmp_path / "store" / "manifest.json").read_text()) == manifest

    r = run_prepare(tmp_path, "docs/guide/index.md", "--out", "one")  # named, not walked
    assert r.returncode == 2 and "--text-ext EXT reads other extensions as text" in r.stderr
    assert run_prepare(tmp_path, "docs/guide/index.md", "--out", "one", "--text-ext", "md").returncode == 0
    assert byte_texts(tmp_path / "one") == [DOCS["guide/index.md"]]


def test_several_json_fields_join_with_a_blank_line(tmp_path):
    records = [{"title": "Fox", "body": "It jumps.", "id": 1},
               {"title": "", "body": "No title here."},
               {"body": "no title key", "title": None}]
    with open(tmp_path / "a.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    (tmp_path / "b.json").write_text(json.dumps(records[:2]))  # a .json array: the same

    r = run_prepare(tmp_path, "a.jsonl", "b.json", "--out", "s", "--text-key", "title,body",
                "--on-error", "skip")
    assert r.returncode == 0, r.stderr
    assert byte_texts(tmp_path / "s") == ["Fox\n\nIt jumps.", "No title here.",
                                     "Fox\n\nIt jumps.", "No title here."]
    skipped = json.loads((tmp_path / "s" / "manifest.json").read_text())["skipped"]
    assert skipped["by_reason"] == {"non_string_field": 1}
    assert skipped["examples"][0]["where"] == "line 3" and "'title' is null" in skipped["examples"][0]["detail"]

    r = run_prepare(tmp_path, "a.jsonl", "--out", "t")  # the default key: the error says what is there
    assert r.returncode == 2
    assert ("a.jsonl:1: missing field (no 'text' key; keys are 'title', 'body', 'id'; several "
            "fields hold text: --text-key title,body joins them)") in r.stderr
    (tmp_path / "c.jsonl").write_text(json.dumps({"id": 7, "content": "hello"}) + "\n")
    r = run_prepare(tmp_path, "c.jsonl", "--out", "u")
    assert "keys are 'id', 'content'; its text may be under --text-key content" in r.stderr

    (tmp_path / "d.csv").write_text("title,body\nA,B\n")
    r = run_prepare(tmp_path, "d.csv", "--out", "v", "--text-key", "title,body")
    assert r.returncode == 2 and "d.csv: text_key=title,body joins the fields of JSON records" in r.stderr

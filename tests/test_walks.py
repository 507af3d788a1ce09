"""How inputs are found, as a user meets it (issue 22, class 3: every record read once, or counted).

Real `tokenmill prepare` processes (python -m tokenmill) on real folders holding real symbolic
links, a git checkout's hidden files and folders; the store's exact documents and the note. One
rule for walks and globs (tokenmill.inputs.walk): hidden names are passed over and counted, a link to a
folder is followed, each folder walked once (a link loop never recurses), each file read once.
"""


from conftest import byte_texts, run_prepare, write_jsonl
from tokenmill import Loader


def note(r) -> str:
    return next(line for line in r.stderr.splitlines() if line.startswith("note: "))


def test_a_link_to_a_folder_is_read_and_a_link_loop_never_recurses(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "shared").mkdir()
    write_jsonl(tmp_path / "data" / "a.jsonl", ["a1", "a2"])
    write_jsonl(tmp_path / "shared" / "b.jsonl", ["b1"])
    (tmp_path / "data" / "more").symlink_to("../shared")  # a folder linked in: read
    (tmp_path / "data" / "loop").symlink_to("..")  # leads back above data: never entered
    r = run_prepare(tmp_path, "data", "--out", "store")
    assert r.returncode == 0, r.stderr
    assert byte_texts(tmp_path / "store") == ["a1", "a2", "b1"]  # before: b1 silently not read
    assert note(r) == (f"note: dropped 1 repeat (a file or folder reached again by another path, "
                       f"read once: data/loop/ = {tmp_path.resolve()}/)")


def test_a_glob_through_a_link_loop_reads_each_file_once(tmp_path):
    (tmp_path / "d3" / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "d3" / "sub" / "x.jsonl", ["x"])
    write_jsonl(tmp_path / "d3" / "y.jsonl", ["y"])
    (tmp_path / "d3" / "loop").symlink_to("..")
    r = run_prepare(tmp_path, "d3/**/*.jsonl", "--out", "store")
    assert r.returncode == 0, r.stderr
    assert byte_texts(tmp_path / "store") == ["x", "y"]  # before: each read 40 times down loop/d3/loop/…
    assert note(r) == (f"note: dropped 1 repeat (a file or folder reached again by another path, "
                       f"read once: d3/loop/ = {tmp_path.resolve()}/)")


def test_a_latest_link_and_two_spellings_of_one_file_give_its_documents_once(tmp_path):
    (tmp_path / "d5" / "v3").mkdir(parents=True)
    write_jsonl(tmp_path / "d5" / "v3" / "a.jsonl", ["one", "two"])
    (tmp_path / "d5" / "latest").symlink_to("v3")
    r = run_prepare(tmp_path, "d5/**/*.jsonl", "--out", "glob")
    assert r.returncode == 0, r.stderr
    assert byte_texts(tmp_path / "glob") == ["one", "two"]  # before: one, two, one, two
    assert note(r) == ("note: dropped 1 repeat (a file or folder reached again by another path, "
                       "read once: d5/latest/ = d5/v3/)")  # the folder itself kept, not the link
    r = run_prepare(tmp_path, "d5/v3/a.jsonl", tmp_path / "d5" / "latest" / "a.jsonl", "--out", "named")
    assert r.returncode == 0, r.stderr
    assert byte_texts(tmp_path / "named") == ["one", "two"]
    assert note(r) == ("note: dropped 1 repeat (a file or folder reached again by another path, "
                       f"read once: d5/v3/a.jsonl = {tmp_path}/d5/latest/a.jsonl)")


GIT = {".env": "SECRET=hunter2\n", ".git/config": "[core]\n", ".git/HEAD": "ref: refs/heads/main\n",
       ".git/logs/HEAD": "0000 1111 a <a@b> commit\n", ".github/ci.md": "# CI\n",
       "README": "read me\n", "guide.md": "# Guide\n", "api.rst": "API\n---\n"}


def test_hidden_files_and_folders_of_a_checkout_are_passed_over_and_said(tmp_path):
    for name, text in GIT.items():
        (tmp_path / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "docs" / name).write_text(text)
    (tmp_path / "docs" / ".ipynb_checkpoints").mkdir()
    write_jsonl(tmp_path / "docs" / ".ipynb_checkpoints" / "x.jsonl", ["a stale copy"])
    r = run_prepare(tmp_path, "docs", "--out", "store", "--text-ext", "md,rst,''", "--on-error", "skip")
    assert r.returncode == 0, r.stderr
    assert byte_texts(tmp_path / "store") == ["read me\n", "API\n---\n", "# Guide\n"]  # before: .env, .git/…
    assert note(r) == ("note: ignored 4 hidden (names starting with '.', e.g. docs/.env, docs/.git/, "
                       "docs/.github/; name one to read it)")
    r = run_prepare(tmp_path, "docs/.env", "--out", "named", "--text-ext", "''")
    assert r.returncode == 0, r.stderr
    assert byte_texts(tmp_path / "named") == [GIT[".env"]]  # named explicitly: the user asked for it


def test_a_stream_lists_inputs_by_the_same_rule(tmp_path):
    (tmp_path / "data" / ".cache").mkdir(parents=True)
    (tmp_path / "v2").mkdir()
    write_jsonl(tmp_path / "data" / "a.jsonl", ["aaaa"])
    write_jsonl(tmp_path / "data" / ".cache" / "a.jsonl", ["stale"])
    write_jsonl(tmp_path / "v2" / "b.jsonl", ["bbbb"])
    (tmp_path / "data" / "v2").symlink_to("../v2")
    (tmp_path / "data" / "loop").symlink_to(".")
    with Loader.from_text([str(tmp_path / "data"), str(tmp_path / "v2" / "b.jsonl")], tokenizer="bytes",
                          seq_len=4, batch_size=1, cache_dir=tmp_path / "cache", num_workers=0) as ld:
        assert [u.path for u in ld.plan.units] == [str(tmp_path / p) for p in ("data/a.jsonl",
                                                                                 "data/v2/b.jsonl")]


def file_url_tree(tmp_path):
    """d/: a.jsonl, .cache/h.jsonl (hidden), more -> ../shared (a folder link) holding b.jsonl."""
    (tmp_path / "d" / ".cache").mkdir(parents=True)
    (tmp_path / "shared").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", ["a"])
    write_jsonl(tmp_path / "d" / ".cache" / "h.jsonl", ["hidden"])
    write_jsonl(tmp_path / "shared" / "b.jsonl", ["b"])
    (tmp_path / "d" / "more").symlink_to("../shared")
    return (tmp_path / "d").as_uri()


def test_a_file_url_walk_or_glob_follows_the_rule_of_local_walks(tmp_path):
    # before: a file:// input went through fsspec's listing: the walk skipped the folder link,
    # the glob read the hidden .cache/ file and not the link, with no note
    url = file_url_tree(tmp_path)
    for i, spelled in enumerate([url, url + "/**/*.jsonl",
                                 "file://localhost" + url.removeprefix("file://"),
                                 "file:" + url.removeprefix("file://")]):
        r = run_prepare(tmp_path, spelled, "--out", f"store{i}", "--tokenizer", "bytes")
        assert r.returncode == 0, r.stderr
        assert byte_texts(tmp_path / f"store{i}") == ["a", "b"], spelled
        assert "1 hidden" in note(r) and "d/.cache/" in note(r), (spelled, r.stderr)


def test_a_file_named_as_a_path_and_as_a_file_url_is_read_once(tmp_path):
    # before: its documents twice (a URL was never compared with a path)
    write_jsonl(tmp_path / "x.jsonl", ["one", "two"])
    r = run_prepare(tmp_path, tmp_path / "x.jsonl", (tmp_path / "x.jsonl").as_uri(), "--out", "store",
                "--tokenizer", "bytes")
    assert r.returncode == 0, r.stderr
    assert byte_texts(tmp_path / "store") == ["one", "two"]
    assert f"file://{tmp_path}/x.jsonl = {tmp_path}/x.jsonl" in note(r), r.stderr
    (tmp_path / "x.jsonl").rename(tmp_path / "x y.jsonl")
    url = "file://" + str(tmp_path / "x%20y.jsonl")  # before: "no input file matched"
    r = run_prepare(tmp_path, url, "--out", "store2", "--tokenizer", "bytes")
    assert r.returncode == 0, r.stderr
    assert byte_texts(tmp_path / "store2") == ["one", "two"]


def test_a_glob_that_spells_the_dot_under_double_star_reads_the_hidden_files_it_names(tmp_path):
    # before: "no file matched (no supported file matches; found only 3 hidden)": ** passed over
    # every hidden name, even those the pattern asked for
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / ".cache").mkdir()
    write_jsonl(tmp_path / "d" / ".a.jsonl", ["top"])
    write_jsonl(tmp_path / "d" / "sub" / ".s.jsonl", ["nested"])
    write_jsonl(tmp_path / "d" / "sub" / "v.jsonl", ["visible"])
    write_jsonl(tmp_path / "d" / ".cache" / "x.jsonl", ["cached"])
    r = run_prepare(tmp_path, "d/**/.*.jsonl", "--out", "dots", "--tokenizer", "bytes")
    assert r.returncode == 0, r.stderr
    assert byte_texts(tmp_path / "dots") == ["top", "nested"]
    assert note(r) == ("note: ignored 1 hidden (names starting with '.', e.g. d/.cache/; name one "
                       "to read it)")  # .cache/ is no .*.jsonl: passed over, and said
    r = run_prepare(tmp_path, "d/**/.cache/*.jsonl", "--out", "folder", "--tokenizer", "bytes")
    assert r.returncode == 0, r.stderr  # a hidden folder the pattern spells is entered
    assert byte_texts(tmp_path / "folder") == ["cached"]


def test_links_that_lead_to_no_file_are_named_as_what_they_are(tmp_path):
    # before: "ignored 5 files: 4 (no extension), 1 .md (e.g. e/dd, e/l1, e/l2); …; --text-ext
    # md,'' reads them as plain text": loops counted as files without an extension
    (tmp_path / "e").mkdir()
    write_jsonl(tmp_path / "e" / "a.jsonl", ["a"])
    (tmp_path / "e" / "notes.md").write_text("# notes\n")
    (tmp_path / "e" / "loop").symlink_to("loop")
    (tmp_path / "e" / "l1").symlink_to("l2")
    (tmp_path / "e" / "l2").symlink_to("l1")
    (tmp_path / "e" / "dd").symlink_to("nowhere")
    r = run_prepare(tmp_path, "e", "--out", "store", "--tokenizer", "bytes")
    assert r.returncode == 0, r.stderr
    assert byte_texts(tmp_path / "store") == ["a"]
    assert note(r) == (
        "note: ignored 1 file: 1 .md (e.g. e/notes.md); passed over 4 links that lead to no file: "
        "e/dd (a dangling link), e/l1 (a link loop), e/l2 (a link loop) and 1 more; prepare "
        "reads regular files of .txt, .jsonl[.gz|.zst], .json[.gz|.zst], .csv, .tsv, .parquet, "
        ".arrow; --text-ext md reads them as plain text (text_ext= in Python)")
    r = run_prepare(tmp_path, "e/l*", "--out", "loops", "--tokenizer", "bytes")
    assert r.returncode == 2
    assert r.stderr.strip() == ("tokenmill prepare: error: e/l*: no file matched (no supported "
                                "file matches; found only 3 link loops); check the path or "
                                "pattern, or pass --on-error skip")

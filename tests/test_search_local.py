"""Local bm25s backend: index build/load, the right document for a hand-written query, corpus errors."""
import json

import pytest

from megatron_search.search import SearchBackendError, build_backend
from megatron_search.search.local import CorpusError, LocalSearchBackend, build_index, make_snippet, read_corpus
from megatron_search.config.rollout import SearchConfig

DOCS = [
    {"id": "mom-test", "title": "The Mom Test", "url": "https://example.org/mom-test",
     "text": "The Mom Test is a book by Rob Fitzpatrick about how to talk to customers."},
    {"id": "yc", "title": "Y Combinator", "url": "https://example.org/yc",
     "text": "Y Combinator is a startup accelerator launched in March 2005."},
    {"id": "seine", "title": "Seine", "url": "https://example.org/seine",
     "text": "The Seine is a river that flows through Paris, the capital of France."},
    {"id": "python", "title": "Python (language)", "url": "https://example.org/python",
     "text": "Python is a programming language created by Guido van Rossum."},
]


def write_corpus(path, docs):
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def test_build_load_and_query_returns_the_right_document(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl", DOCS)
    n = build_index(read_corpus(corpus), tmp_path / "index", progress=False)
    assert n == 4
    backend = LocalSearchBackend.load(tmp_path / "index")
    hits = backend.search("which accelerator was launched in March 2005", k=10)
    assert hits[0].doc_id == "yc" and hits[0].url == "https://example.org/yc" and hits[0].title == "Y Combinator"
    assert backend.search("who wrote the mom test book", k=1)[0].doc_id == "mom-test"
    # Only documents that share a term are returned (no zero-score padding); k caps the count.
    assert [h.doc_id for h in backend.search("river Paris", k=10)] == ["seine"]
    assert len(backend.search("the is a", k=10)) == 0  # only stopwords
    assert len(backend.search("python programming language seine river paris", k=1)) == 1


def test_rebuild_replaces_index_atomically(tmp_path):
    build_index(DOCS, tmp_path / "index", progress=False)
    build_index(DOCS[:2], tmp_path / "index", progress=False)
    backend = LocalSearchBackend.load(tmp_path / "index")
    assert len(backend) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]  # no temp or old directories left


@pytest.mark.parametrize("line, message", [
    ("{not json", "corpus.jsonl:2: not valid JSON"),
    ('{"id": "x", "title": "t", "url": "u"}', "corpus.jsonl:2: field 'text' must be a string"),
    ('["a"]', "corpus.jsonl:2: expected a JSON object"),
    (json.dumps(DOCS[0]), "corpus.jsonl:2: duplicate document id 'mom-test'"),
])
def test_corpus_errors_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps(DOCS[0]) + "\n" + line + "\n")
    with pytest.raises(CorpusError, match=message.replace("(", r"\(")):
        list(read_corpus(path))


def test_missing_index_is_a_clear_error(tmp_path):
    with pytest.raises(SearchBackendError, match="not a search index"):
        LocalSearchBackend.load(tmp_path)
    with pytest.raises(SearchBackendError, match="needs search.index_dir"):
        build_backend(SearchConfig(backend="local"))


def test_config_builds_index_on_first_use(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", DOCS)
    cfg = SearchConfig(backend="local", corpus=str(corpus), index_dir=str(tmp_path / "idx"), snippet_chars=40)
    backend = build_backend(cfg)
    assert (tmp_path / "idx" / "meta.json").is_file()
    hit = backend.search("Guido van Rossum", k=3)[0]
    assert hit.doc_id == "python" and len(hit.snippet) <= 40 + 6  # two "..." markers at most


def test_snippet_centres_on_the_first_query_term():
    text = "alpha " * 50 + "needle in the haystack " + "omega " * 50
    snip = make_snippet(text, {"needle"}, 60)
    assert "needle" in snip and snip.startswith("...") and snip.endswith("...")
    assert make_snippet("short text", {"x"}, 60) == "short text"
    assert make_snippet(text, {"absent"}, 30).startswith("alpha")


def test_build_index_cli(tmp_path, capsys):
    from megatron_search.cli import main

    corpus = write_corpus(tmp_path / "c.jsonl", DOCS)
    rc = main(["build-index", "--corpus", str(corpus), "--index-dir", str(tmp_path / "idx"), "--query", "Seine river"])
    out = capsys.readouterr().out
    assert rc == 0 and "indexed 4 documents" in out and "[1] Seine <https://example.org/seine> (seine)" in out
    assert main(["build-index", "--corpus", str(tmp_path / "missing.jsonl"), "--index-dir", str(tmp_path / "x")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err

from __future__ import annotations

from foundry.data import builtin_corpus_documents
from foundry.data.corpus import builtin_instruction_rows


def test_builtin_corpus_is_substantial_english_text() -> None:
    documents = builtin_corpus_documents()
    text = "".join(documents)
    assert len(documents) > 50
    assert len(text.encode("utf-8")) > 300_000
    words = text.lower().split()
    assert words.count("the") > 1000  # English prose, not just code


def test_builtin_corpus_order_is_fixed(monkeypatch) -> None:
    """Sorted by topic name, not in the module's insertion order (which may differ between Python builds)."""
    from pydoc_data import topics

    documents = builtin_corpus_documents()
    monkeypatch.setattr(topics, "topics", dict(reversed(list(topics.topics.items()))))
    assert builtin_corpus_documents() == documents
    assert documents[0].startswith('The "assert" statement')


def test_builtin_instructions_ask_about_every_topic_with_prose_answers() -> None:
    rows = builtin_instruction_rows()
    assert len(rows) == 2 * len(builtin_corpus_documents())
    explain = rows[0]
    assert explain["prompt"] == "Explain the Python help topic 'assert'.\n"
    assert explain["response"].startswith("Assert statements are a convenient way")
    assert rows[1]["response"] == 'The "assert" statement'
    assert all(row["response"].strip() and "\n" not in row["response"] for row in rows)

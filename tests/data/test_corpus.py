from __future__ import annotations

from foundry.data import builtin_corpus_documents


def test_builtin_corpus_is_substantial_english_text() -> None:
    documents = builtin_corpus_documents()
    text = "".join(documents)
    assert len(documents) > 50
    assert len(text.encode("utf-8")) > 300_000
    words = text.lower().split()
    assert words.count("the") > 1000  # English prose, not just code


def test_builtin_corpus_order_is_fixed() -> None:
    assert builtin_corpus_documents() == builtin_corpus_documents()
    assert builtin_corpus_documents()[0].startswith('The "assert" statement')

"""The default corpus: English text that ships with Python itself, so the quickstart needs no download."""

from __future__ import annotations

from foundry.errors import DataError


def builtin_corpus_documents() -> list[str]:
    """Python's help topics (``pydoc_data.topics``): 79 documents, ~465 KB of English prose and code.

    Documents come sorted by topic name, so a conversion of this corpus is the same on every machine
    running the same Python version.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError as error:
        raise DataError(
            "The builtin corpus needs Python's 'pydoc_data' module, which this Python installation lacks "
            "(some minimal distributions strip it). Pass your own .txt/.jsonl files to 'foundry data convert' "
            "instead, or install the full Python standard library."
        ) from error
    return [topics[name] for name in sorted(topics)]

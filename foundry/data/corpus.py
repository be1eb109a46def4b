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


def builtin_instruction_rows() -> list[dict[str, str]]:
    """Prompt/response rows derived from the help topics, so the finetune quickstart needs no download.

    Two artificial tasks per topic (158 rows): "Explain the Python help topic 'X'." → the topic's
    first paragraph of prose, and "Give the section title of the Python help topic 'X'." → its title.
    """
    from pydoc_data.topics import topics  # builtin_corpus_documents() has already explained a failure

    builtin_corpus_documents()
    rows = []
    for name in sorted(topics):
        title, paragraph = _title_and_first_paragraph(topics[name])
        rows.append({"prompt": f"Explain the Python help topic '{name}'.\n", "response": paragraph})
        rows.append({"prompt": f"Give the section title of the Python help topic '{name}'.\n", "response": title})
    return rows


def builtin_preference_rows() -> list[dict[str, str]]:
    """Preference pairs from ``builtin_instruction_rows``, so the DPO quickstart needs no download: each row's
    response is ``chosen``, and the same words in reverse order (a corrupted answer) are ``rejected``."""
    return [
        {"prompt": row["prompt"], "chosen": row["response"], "rejected": " ".join(reversed(row["response"].split()))}
        for row in builtin_instruction_rows()
    ]


def _title_and_first_paragraph(document: str) -> tuple[str, str]:
    """The first line, and the first paragraph that is prose (not indented code, not a heading rule)."""
    paragraphs = document.split("\n\n")
    title = paragraphs[0].splitlines()[0].strip()
    for paragraph in paragraphs[1:]:
        if paragraph.strip() and not paragraph.startswith(" ") and not set(paragraph.strip()) <= set("*=-"):
            return title, " ".join(line.strip() for line in paragraph.splitlines())
    return title, title

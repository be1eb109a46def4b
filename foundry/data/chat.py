"""Finetuning rows → (prompt, response) text turns: prompt/response pairs and chat ``messages``.

A chat row is cut into one turn per assistant message, as LLM Foundry does: the turn's prompt is
everything the template renders before that message (with the generation prompt), its response
the message as rendered. The tokenizer's own chat template renders it when the tokenizer has one;
otherwise ``PLAIN_CHAT_TEMPLATE``, which writes each message as ``<|role|>\\n{content}\\n``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

PROMPT_KEYS = ("prompt", "input")  # LLM Foundry's accepted spellings
RESPONSE_KEYS = ("response", "output")
MESSAGES_KEYS = ("messages", "conversation")
ROLES = ("system", "user", "assistant", "tool")
PLAIN_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"  # used when the tokenizer has no chat_template

TextTurn = tuple[str, str]  # (prompt, response)
RenderChat = Callable[[Sequence[Mapping[str, str]], bool], str]  # (messages, add_generation_prompt) -> text


class RowFormatError(ValueError):
    """A row that is not a prompt/response pair or a valid chat; the caller adds file and line."""


def text_turns(row: Any, render: RenderChat) -> tuple[list[TextTurn], bool]:
    """The row's turns, and whether it is a chat (whose special tokens come from the template)."""
    if not isinstance(row, Mapping):
        raise RowFormatError(f"a row must be a JSON object, got {type(row).__name__}")
    messages_key = next((key for key in MESSAGES_KEYS if key in row), None)
    if messages_key is not None:
        return chat_turns(row[messages_key], render), True
    prompt_key = next((key for key in PROMPT_KEYS if key in row), None)
    response_key = next((key for key in RESPONSE_KEYS if key in row), None)
    if prompt_key is None or response_key is None:
        raise RowFormatError(f"a row needs 'prompt' and 'response' keys (or 'messages'); this one has {sorted(row)}")
    for key in (prompt_key, response_key):
        if not isinstance(row[key], str):
            raise RowFormatError(f"'{key}' must be a string, got {type(row[key]).__name__}")
    return [(row[prompt_key], row[response_key])], False


def chat_turns(messages: Any, render: RenderChat) -> list[TextTurn]:
    """One (prompt, response) turn per assistant message; each prompt holds what came since the last turn."""
    _check_messages(messages)
    turns: list[TextTurn] = []
    rendered_so_far = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        with_prompt = render(messages[:index], True)
        through_turn = render(messages[: index + 1], False)
        if not (with_prompt.startswith(rendered_so_far) and through_turn.startswith(with_prompt)):
            raise RowFormatError(
                "the chat template does not render a conversation as a prefix of its continuation, so prompts "
                "and responses cannot be separated; use a template that only appends per message"
            )
        turns.append((with_prompt[len(rendered_so_far) :], through_turn[len(with_prompt) :]))
        rendered_so_far = through_turn
    return turns


def chat_renderer(tokenizer: Any) -> RenderChat:
    """The tokenizer's chat template when it has one, else ``PLAIN_CHAT_TEMPLATE``."""
    if getattr(tokenizer, "chat_template", None):

        def render_with_template(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
            try:
                return tokenizer.apply_chat_template(
                    list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
                )
            except Exception as error:  # jinja raises TemplateError, templates raise their own exceptions
                raise RowFormatError(f"the tokenizer's chat template failed: {error}") from error

        return render_with_template
    return render_plain_chat


def render_plain_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
    text = "".join(PLAIN_CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or len(messages) < 2:
        raise RowFormatError("'messages' must be a list of at least two {role, content} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
            raise RowFormatError(f"message {index} must be an object with exactly 'role' and 'content'")
        if message["role"] not in ROLES:
            raise RowFormatError(f"message {index} has role {message['role']!r}; roles are {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise RowFormatError(f"message {index}'s content must be a string, got {type(message['content']).__name__}")
    if messages[-1]["role"] != "assistant":
        raise RowFormatError("the last message must be the assistant's (the response to train on)")

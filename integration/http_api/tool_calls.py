"""Tools on the chat route, response side: the generated JSON becomes ``tool_calls`` (the stock
``router/src/chat.rs`` and ``chat_completions`` in ``server.rs``).

A call is ``{"function": {"_name": NAME, ARG: VALUE, ...}}`` (other top-level keys ignored).

* Not streaming: ``_name == "no_tool"`` means the router asks again *without* tools (plain prompt,
  no grammar) and answers with that text; otherwise the message is ``{"role": "assistant",
  "tool_calls": [{"id": "0", "type": "function", "function": {"description": null, "name": NAME,
  "arguments": "<the remaining keys as compact JSON>"}}]}``. Text that is not a call is a 422
  ``Tool error: Failed to parse generated text: <serde error> "<text>"``.
* Streaming (:class:`ToolCallStream`): tokens are buffered until the text, with trailing whitespace,
  commas and braces cut and ``}}`` added, parses as a call. Then ``no_tool`` restarts the request
  without tools (nothing was sent yet); any other name sends one delta whose ``arguments`` is ``{``
  and whose ``name`` is the tool's, after which each token is a delta of its own text (``name:
  null``), until the text parses as a whole call: that token is sent with its trailing whitespace and
  one ``}`` cut, and buffering starts again (so the token that ends the stream is usually swallowed
  with its ``finish_reason``, as stock does). A special token sends ``{"role": "assistant",
  "content": ""}`` instead. Deltas carry ``id`` :func:`next_tool_call_id`.

Error wording: ``serde_json``'s messages (``EOF while parsing an object at line 1 column 20``,
``missing field `function```) are reproduced for the usual cases; positions of errors inside nested
values are approximate.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from integration.router_replay.grammar import serde_json_text, serde_parse_error

from .schemas import ChatMessage, tool_error

NO_TOOL_NAME = "no_tool"


class _NotCall(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise _NotCall(name)


def _kind(value: Any) -> str:
    """serde's ``Unexpected`` wording for a JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{serde_json_text(value)}`"
    if isinstance(value, str):
        return f"string {json.dumps(value, ensure_ascii=False)}"
    return "sequence" if isinstance(value, list) else "map"


def _call(value: Any) -> tuple[str, dict[str, Any]]:
    """``(name, arguments)`` of a parsed call; raises ``_NotCall`` with serde's message."""
    if not isinstance(value, dict):
        raise _NotCall(f"invalid type: {_kind(value)}, expected struct Call")
    if "function" not in value:
        raise _NotCall("missing field `function`")
    function = value["function"]
    if not isinstance(function, dict):
        raise _NotCall(f"invalid type: {_kind(function)}, expected struct ToolCall")
    if "_name" not in function:
        raise _NotCall("missing field `_name`")
    name = function["_name"]
    if not isinstance(name, str):
        raise _NotCall(f"invalid type: {_kind(name)}, expected a string")
    return name, {k: v for k, v in function.items() if k != "_name"}


def parse_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """``(name, arguments)`` when ``text`` is exactly one call (JSON, surrounding whitespace allowed)."""
    try:
        return _call(json.loads(text, parse_constant=_reject_constant))
    except ValueError:
        return None


def _where(text: str) -> str:
    stripped = text.rstrip(" \t\n\r")
    line = stripped.count("\n") + 1
    return f"line {line} column {len(stripped) - (stripped.rfind(chr(10)) + 1)}"


def rust_debug(text: str) -> str:
    """A string as Rust's ``{:?}`` prints it."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\0":
            out.append("\\0")
        elif ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0:
            out.append(f"\\u{{{ord(ch):x}}}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def parse_output(generated_text: str) -> list[dict[str, Any]] | None:
    """The stock ``parse_output``: the ``tool_calls`` of a finished answer, ``None`` for ``no_tool``."""
    try:
        value = json.loads(generated_text, parse_constant=_reject_constant)
    except _NotCall as err:
        detail = f"invalid constant {err} at {_where(generated_text)}"
    except ValueError as err:
        detail = serde_parse_error(generated_text, err)
    else:
        try:
            name, arguments = _call(value)
        except _NotCall as err:
            detail = f"{err} at {_where(generated_text)}"
        else:
            if name == NO_TOOL_NAME:
                return None
            return [
                {
                    "id": "0",
                    "type": "function",
                    "function": {"description": None, "name": name, "arguments": serde_json_text(arguments)},
                }
            ]
    raise tool_error(f"Failed to parse generated text: {detail} {rust_debug(generated_text)}")


def _rust_trim_end(text: str, extra: str = "") -> str:
    """``trim_end`` (Unicode ``White_Space``; Python's ``isspace`` also counts U+001C..U+001F) plus ``extra``."""
    end = len(text)
    while end and ((text[end - 1].isspace() and not "\x1c" <= text[end - 1] <= "\x1f") or text[end - 1] in extra):
        end -= 1
    return text[:end]


class NoTool:
    """The model chose ``no_tool``: answer again without tools."""


NO_TOOL = NoTool()


class ToolCallStream:
    """The stock streaming ``ChatState`` while tools are used: one call per token."""

    def __init__(self) -> None:
        self.text = ""
        self.in_call = False

    def push(self, token_text: str) -> NoTool | tuple[str, str | None] | None:
        """``NO_TOOL``; ``(arguments text, name or None)`` to send; or ``None`` (buffered)."""
        self.text += token_text
        if not self.in_call:
            call = parse_call(_rust_trim_end(self.text, ",}") + "}}")
            if call is None:
                return None
            if call[0] == NO_TOOL_NAME:
                return NO_TOOL
            self.in_call = True
            return "{", call[0]
        if parse_call(self.text) is None:
            return token_text, None
        self.in_call = False
        text = _rust_trim_end(token_text)
        return (text[:-1] if text.endswith("}") else text), None


_USIZE = re.compile(r"\+?[0-9]+")


def next_tool_call_id(messages: list[ChatMessage]) -> str:
    """One more than the largest integer id of the conversation's tool calls (``"0"`` without any);
    a uuid4 when an id is not an unsigned integer."""
    next_id = 0
    for message in messages:
        for call in message.calls or []:
            if not _USIZE.fullmatch(call.id) or int(call.id) >= 2**64:
                return str(uuid.uuid4())
            next_id = max(next_id, int(call.id) + 1)
    return str(next_id)


def tool_delta(call_id: str, arguments: str, name: str | None, special: bool) -> dict[str, Any]:
    """A streamed tool-call delta (a special token sends an empty content delta instead)."""
    if special:
        return {"role": "assistant", "content": ""}
    return {
        "role": "assistant",
        "tool_calls": [
            {"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        ],
    }

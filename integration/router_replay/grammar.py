"""The stock router's grammar validation (``router/src/validation.rs``): JSON schemas become regexes.

The stock router accepts three ``GrammarType`` values and sends the shard only regexes
(``GRAMMAR_TYPE_REGEX``):

* ``regex``: passed through unchecked (a plain ``str`` here);
* ``json`` (alias ``json_object``): the value is a schema object, or a string holding one (parsed
  again); any other JSON value is refused with ``grammar is not supported``;
* ``json_schema``: ``{"name": ..., "schema": ...}``; the ``schema`` is used.

A schema must pass the JSON Schema draft 2020-12 meta-schema (``grammar is not valid: <first
error>``), must have a ``properties`` key (``grammar is not valid: Grammar must have a 'properties'
field``), and is compiled with outlines-core's ``build_regex_from_schema`` (default whitespace
pattern), which the stock router calls through the outlines-core crate (``cannot compile regex from
schema: <error>``). All are validation errors (422, ``error_type: validation``), raised after the
input-length checks, as stock orders them.

Library wording: meta-schema errors are rendered in the ``jsonschema`` crate's style (``"foo" is not
valid under any of the schemas listed in the 'anyOf' keyword``) from the Python ``jsonschema``
package's first error (formats are annotations, as in the crate's meta validation); string
values that are not JSON get ``serde_json``-style messages (``expected value at line 1 column 1``).
Keywords without a known crate wording keep the Python message.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from .errors import ValidationError


@dataclass(frozen=True)
class SchemaGrammar:
    """A ``json`` / ``json_schema`` grammar the router compiles to a regex before scheduling."""

    value: Any
    """``json``: the client's value (an object, or a string holding JSON); ``json_schema``: the schema."""
    kind: Literal["json", "json_schema"] = "json"


def grammar_regex(grammar: str | SchemaGrammar | None) -> str | None:
    """The regex the shard receives; raises :class:`ValidationError` with the stock messages."""
    if grammar is None or isinstance(grammar, str):
        return grammar
    schema = grammar.value
    if grammar.kind == "json":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema, parse_constant=_reject_constant)
            except ValueError as err:
                raise ValidationError(f"grammar is not valid: {serde_parse_error(schema, err)}") from None
        elif not isinstance(schema, dict):
            raise ValidationError("grammar is not supported")
    problem = meta_schema_error(schema)
    if problem is not None:
        raise ValidationError(f"grammar is not valid: {problem}")
    if not isinstance(schema, dict) or "properties" not in schema:
        raise ValidationError("grammar is not valid: Grammar must have a 'properties' field")
    return _compile(json.dumps(schema, ensure_ascii=False, allow_nan=False))


@lru_cache(maxsize=256)
def _compile(schema_json: str) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    try:
        return build_regex_from_schema(schema_json)
    except (ValueError, TypeError) as err:
        raise ValidationError(f"cannot compile regex from schema: {err}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"invalid constant {name}")


# -- serde_json-style text ---------------------------------------------------------------------


def _float_text(value: float) -> str:
    """``f64`` as ``serde_json`` prints it (``1e16``, ``1e-7``; Python writes ``1e+16``, ``1e-07``)."""
    text = repr(value)
    if "e" in text:
        mantissa, exponent = text.split("e")
        sign = "-" if exponent.startswith("-") else ""
        text = f"{mantissa}e{sign}{exponent.lstrip('+-').lstrip('0') or '0'}"
    return text


def serde_json_text(value: Any) -> str:
    """Compact JSON as ``serde_json::to_string`` writes it (insertion order, UTF-8 kept)."""
    if isinstance(value, float) and math.isfinite(value):
        return _float_text(value)
    if isinstance(value, dict):
        return (
            "{"
            + ",".join(f"{json.dumps(str(k), ensure_ascii=False)}:{serde_json_text(v)}" for k, v in value.items())
            + "}"
        )
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(serde_json_text(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


_SERDE_MESSAGES = (
    ("Expecting value", "expected value"),
    ("Extra data", "trailing characters"),
    ("Expecting property name enclosed in double quotes", "key must be a string"),
    ("Expecting ':' delimiter", "expected `:`"),
    ("Expecting ',' delimiter", "expected `,` or `}`"),
    ("Invalid control character", "control character (\\u0000-\\u001F) found while parsing a string"),
    ("Invalid \\escape", "invalid escape"),
)


def _line_column(text: str, pos: int) -> str:
    """serde's position: 1-based line, column of the character it stopped at (0 past a newline)."""
    line = text.count("\n", 0, pos) + 1
    return f"line {line} column {pos - (text.rfind(chr(10), 0, pos) + 1)}"


def _open_construct(text: str) -> str:
    """What an unfinished JSON text is in the middle of (serde's ``EOF while parsing ...``)."""
    stack: list[str] = []
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append(ch)
        elif ch in "}]" and stack:
            stack.pop()
    if in_string:
        return "a string"
    if stack:
        return "an object" if stack[-1] == "{" else "a list"
    return "a value"


def serde_parse_error(text: str, err: ValueError) -> str:
    """``serde_json``'s message for a text Python's ``json`` refused (wording mapped, position kept)."""
    if not isinstance(err, json.JSONDecodeError):
        return f"{err} at {_line_column(text, len(text))}"
    if not text[err.pos :].strip() or err.msg.startswith("Unterminated string"):
        return f"EOF while parsing {_open_construct(text)} at {_line_column(text, len(text))}"
    message = next((serde for py, serde in _SERDE_MESSAGES if err.msg.startswith(py)), err.msg)
    if message == "expected `,` or `}`" and _open_construct(text[: err.pos]) == "a list":
        message = "expected `,` or `]`"
    return f"{message} at {_line_column(text, err.pos + 1)}"


# -- meta-schema validation in the jsonschema crate's words -----------------------------------------

_RUST_TYPE_ORDER = ("array", "boolean", "integer", "null", "number", "object", "string")


def _plural(n: Any, one: str, many: str) -> str:
    return one if n == 1 else many


def _enum_options(options: list[Any]) -> str:
    shown = [serde_json_text(o) for o in options]
    if len(shown) <= 3:
        return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + f" or {shown[-1]}"
    return ", ".join(shown[:2]) + f" or {len(shown) - 2} other candidates"


def _crate_message(error: Any) -> str:
    keyword, limit, instance = error.validator, error.validator_value, serde_json_text(error.instance)
    if keyword == "type":
        types = [limit] if isinstance(limit, str) else sorted(limit, key=_RUST_TYPE_ORDER.index)
        if len(types) == 1:
            return f'{instance} is not of type "{types[0]}"'
        return f"{instance} is not of types " + ", ".join(f'"{t}"' for t in types)
    simple = {
        "anyOf": f"{instance} is not valid under any of the schemas listed in the 'anyOf' keyword",
        "oneOf": f"{instance} is not valid under any of the schemas listed in the 'oneOf' keyword",
        "minimum": f"{instance} is less than the minimum of {serde_json_text(limit)}",
        "maximum": f"{instance} is greater than the maximum of {serde_json_text(limit)}",
        "exclusiveMinimum": f"{instance} is less than or equal to the minimum of {serde_json_text(limit)}",
        "exclusiveMaximum": f"{instance} is greater than or equal to the maximum of {serde_json_text(limit)}",
        "minLength": f"{instance} is shorter than {limit} character{_plural(limit, '', 's')}",
        "maxLength": f"{instance} is longer than {limit} character{_plural(limit, '', 's')}",
        "minItems": f"{instance} has less than {limit} item{_plural(limit, '', 's')}",
        "maxItems": f"{instance} has more than {limit} item{_plural(limit, '', 's')}",
        "uniqueItems": f"{instance} has non-unique elements",
        "const": f"{serde_json_text(limit)} was expected",
        "pattern": f'{instance} does not match "{limit}"',
    }
    if keyword in simple:
        return simple[keyword]
    if keyword == "enum" and isinstance(limit, list) and limit:
        return f"{instance} is not one of {_enum_options(limit)}"
    if keyword == "required":
        missing = next((p for p in limit if isinstance(error.instance, dict) and p not in error.instance), None)
        return f"{serde_json_text(missing)} is a required property"
    return error.message


def meta_schema_error(schema: Any) -> str | None:
    """The first draft 2020-12 meta-schema error of ``schema``, or ``None`` when it is a valid schema."""
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(Draft202012Validator.META_SCHEMA, format_checker=None)
    error = next(iter(validator.iter_errors(schema)), None)
    return None if error is None else _crate_message(error)

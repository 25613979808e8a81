"""Tools on the chat route, request side: ``tools`` + ``tool_choice`` -> a JSON-schema grammar and a
tool prompt (the stock ``router/src/infer/tool_grammar.rs``, ``infer/chat_template.rs`` and
``ChatRequest::try_into_generate`` in ``lib.rs``).

* ``tool_choice``: absent/``null``/``"auto"`` = every tool plus ``no_tool`` (an open answer);
  ``"required"`` = every tool; ``"none"`` = no tools at all (a plain chat request); any other string,
  or ``{"type": "function", "function": {"name": ...}}``, = that one tool (``Tool error: Tool with
  name X not found`` when it is not listed).
* The grammar is a ``json`` grammar over ``{"$functions": {name: {...}}, "properties": {"function":
  {"anyOf": [{"$ref": "#/$functions/name"}, ...]}}}``; each function's object has a ``_name`` const
  first, then the tool's own ``properties``, ``required`` = ``["_name", *tool required]``,
  ``additionalProperties`` true only when the tool says so with the *string* ``"true"`` (stock reads
  it with ``as_str``), and ``description`` (``""`` when absent). The router replay compiles it like
  any other ``json`` grammar, so its 422 bodies are the grammar ones.
* The prompt: the chosen tools (stock JSON: ``{"type", "function": {"description", "name",
  "arguments": "<schema as a JSON string>"}}``) go to the chat template as ``tools``; when the template
  does not use ``tools``, ``"\\n---\\n" + <tools JSON> + "\\n" + tool_prompt`` is appended to the last
  message's content, else only ``"\\n---\\n" + tool_prompt`` (an empty ``tool_prompt`` means the default).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from typing import Any

from integration.router_replay.grammar import serde_json_text

from .schemas import ChatMessage, FunctionDefinition, JsonGrammar, Tool, TypedChoice, template_error, tool_error

DEFAULT_TOOL_PROMPT = (
    "\nGiven the functions available, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt. Respond in the format {name: function name, parameters: "
    "dictionary of argument name and its value}.Do not use variables.\n"
)
NO_TOOL = Tool(
    type="function",
    function=FunctionDefinition(
        name="no_tool", description="Open ended response with no specific tool selected", arguments={"type": "object"}
    ),
)
"""Added under ``tool_choice: auto``: the model may answer without a tool (then the router answers again
without tools)."""


def chosen_tools(tools: list[Tool], choice: str | TypedChoice | None) -> list[Tool] | None:
    """The tools the grammar offers; ``None`` = generate as if no tools were given."""
    if choice is None or choice == "auto":
        chosen = [*tools, NO_TOOL]
    elif choice == "required":
        chosen = list(tools)
    elif choice == "none":
        chosen = []
    else:
        name = choice if isinstance(choice, str) else choice.function.name
        match = next((t for t in tools if t.function.name == name), None)
        if match is None:
            raise tool_error(f"Tool with name {name} not found")
        chosen = [match]
    return chosen or None


def tool_schema(tools: list[Tool]) -> dict[str, Any]:
    """The JSON schema whose regex constrains a tool call (``{"function": {"_name": ..., args...}}``)."""
    functions: dict[str, Any] = {}
    for tool in tools:
        func = tool.function
        params: dict[str, Any] = {"description": func.description or ""}
        properties: dict[str, Any] = {"_name": {"type": "string", "const": func.name}}
        required: list[Any] = ["_name"]
        args = func.arguments
        if isinstance(args, dict):
            if isinstance(args.get("properties"), dict):
                properties.update(args["properties"])
            if isinstance(args.get("required"), list):
                required.extend(args["required"])
            params["additionalProperties"] = args.get("additionalProperties") == "true"
        params["properties"] = properties
        params["required"] = required
        functions[func.name] = params
    return {
        "$functions": functions,
        "properties": {"function": {"anyOf": [{"$ref": f"#/$functions/{t.function.name}"} for t in tools]}},
    }


def tool_grammar(tools: list[Tool]) -> JsonGrammar:
    return JsonGrammar(type="json", value=tool_schema(tools))


def tool_prompt_text(tools: list[Tool], tool_prompt: str | None, template_uses_tools: bool) -> str:
    """What stock appends to the last message's content."""
    prompt = tool_prompt or DEFAULT_TOOL_PROMPT
    if template_uses_tools:
        return f"\n---\n{prompt}"
    return f"\n---\n{serde_json_text([t.stock_json() for t in tools])}\n{prompt}"


# -- chat template ----------------------------------------------------------------------------------

Renderer = Callable[..., str]
"""``render(messages, tools=None) -> prompt``; ``render.uses_tools``: whether the template reads ``tools``."""


def template_uses_tools(template: Any) -> bool:
    """Whether a Jinja chat template reads the ``tools`` variable (stock: its undeclared variables)."""
    if isinstance(template, dict):
        return any(template_uses_tools(t) for t in template.values())
    if not isinstance(template, str):
        return False
    import jinja2
    from jinja2 import meta

    source = template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateError:
        return re.search(r"\btools\b", source) is not None
    return "tools" in meta.find_undeclared_variables(ast)


def tokenizer_chat_template(tokenizer: Any) -> Renderer:
    """A renderer over ``tokenizer.apply_chat_template``; raises ``template_error`` when it has none.

    As stock, a trailing assistant message is continued: the rendering is cut right after its text.
    """

    def render(messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None) -> str:
        if not getattr(tokenizer, "chat_template", None) or not hasattr(tokenizer, "apply_chat_template"):
            raise template_error("template not found")
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # noqa: BLE001 - jinja errors, raise_exception() in templates
            raise template_error(str(err)) from None
        if messages and messages[-1]["role"] == "assistant":
            content = messages[-1]["content"]
            cut = text.rfind(content)
            if cut >= 0:
                text = text[: cut + len(content)].rstrip()
        return text

    render.uses_tools = template_uses_tools(getattr(tokenizer, "chat_template", None))  # type: ignore[attr-defined]
    with contextlib.suppress(Exception):  # compiled now, as the stock router compiles its template at start
        render([{"role": "user", "content": "hi"}])
    return render


def render_chat(
    render: Renderer | None, messages: list[ChatMessage], tools: list[Tool] | None, tool_prompt: str | None
) -> str:
    """The prompt: messages flattened to text, the tool prompt appended to the last content message."""
    if render is None:
        raise template_error("template not found")
    appended = ""
    if tools is not None:
        appended = tool_prompt_text(tools, tool_prompt, bool(getattr(render, "uses_tools", False)))
    last = len(messages) - 1
    flat = [{"role": m.role, "content": m.text(appended if i == last else "")} for i, m in enumerate(messages)]
    if tools is None:
        return render(flat)
    return render(flat, tools=[t.stock_json() for t in tools])

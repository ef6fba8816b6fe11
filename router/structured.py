"""The constraint fields of a request body: response_format, structured_outputs (vLLM's),
and tools with tool_choice and parallel_tool_calls (chat only).

Each becomes one StructuredOutputsParams for the decode worker's grammar, or none. What
pure Python can check is checked here (shapes, types, names), as an APIError(400)
naming the field; whether xgrammar can compile a schema, regex or grammar is found on
the decode worker, whose 400 names the field as the client sent it (`source`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.structured.params import StructuredOutputsError, StructuredOutputsParams
from engine.user_values import show
from router.errors import APIError

_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # fullmatch
# A function with no parameters schema takes an object of anything.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolChoice:
    """How a chat request may call its tools."""

    mode: ToolMode
    parameters: dict[str, dict[str, Any]]  # each defined tool's parameters schema, by name
    named: str | None = None  # mode "named": the function it must call
    parallel: bool = True  # parallel_tool_calls
    definitions: list[dict[str, Any]] = field(default_factory=list)  # as sent, for the chat template


@dataclass(frozen=True)
class Constraint:
    """The request's grammar, and where the client described it."""

    params: StructuredOutputsParams
    source: str  # the field as the client sent it, e.g. "response_format.json_schema.schema"


def constraint(body: dict[str, Any], tools: ToolChoice | None) -> Constraint | None:
    """The one grammar the body asks for, if any."""
    found = [c for c in (_response_format(body.get("response_format")),
                         _structured_outputs(body.get("structured_outputs")),
                         _tool_constraint(tools)) if c is not None]
    if len(found) > 1:
        names = " and ".join(c.source.split(".")[0] for c in found)
        raise APIError(400, f"{names} both constrain the output; send one of them", found[0].source.split(".")[0])
    return found[0] if found else None


def worker_error(exc: APIError, source: str | None) -> APIError:
    """A decode worker's 400 about structured_outputs.<key>, said with the client's name
    for that field."""
    if source is None or exc.param is None or not exc.param.startswith("structured_outputs"):
        return exc
    message = exc.message.replace(exc.param, source, 1)
    return APIError(exc.status, message, source.split(".")[0].split("[")[0], exc.kind)


def _response_format(value: Any) -> Constraint | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(StructuredOutputsParams(json_object=True), "response_format")
    if kind != "json_schema":
        raise APIError(400, 'response_format must be {"type": "text"}, {"type": "json_object"} or '
                            f'{{"type": "json_schema", "json_schema": {{...}}}}, got {show(value)}',
                       "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, f"response_format.json_schema must be an object with name and schema, got "
                            f"{show(spec)}", "response_format")
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and _TOOL_NAME.fullmatch(name)):
        raise APIError(400, "response_format.json_schema.name must be 1-64 letters, digits, _ or -, got "
                            f"{show(name)}", "response_format")
    for key in ("strict",):
        if spec.get(key) is not None and not isinstance(spec[key], bool):
            raise APIError(400, f"response_format.json_schema.{key} must be a boolean, got {show(spec[key])}",
                           "response_format")
    schema = spec.get("schema", _ANY_OBJECT)
    if not isinstance(schema, (dict, bool)):
        raise APIError(400, f"response_format.json_schema.schema must be a JSON schema object, got "
                            f"{show(schema)}", "response_format")
    return Constraint(_params("response_format.json_schema.schema", json=json.dumps(schema)),
                      "response_format.json_schema.schema")


def _structured_outputs(value: Any) -> Constraint | None:
    if value is None:
        return None
    try:
        params = StructuredOutputsParams.of(value)
    except StructuredOutputsError as exc:
        raise APIError(400, str(exc), "structured_outputs") from None
    return Constraint(params, f"structured_outputs.{params.kind}")


def _params(source: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except StructuredOutputsError as exc:
        raise APIError(400, f"{source} {exc.problem}", source.split(".")[0]) from None


def tool_choice(body: dict[str, Any]) -> ToolChoice | None:
    """tools, tool_choice and parallel_tool_calls, checked; None without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, f"parallel_tool_calls must be a boolean, got {show(parallel)}", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise APIError(400, f"tool_choice={show(choice)} needs tools: none are defined", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise APIError(400, f"tools must be a list of function tools, got {show(tools)}", "tools")
    parameters = {}
    for i, tool in enumerate(tools):
        name, schema = _tool(i, tool)
        if name in parameters:
            raise APIError(400, f"tools[{i}].function.name {name!r} is defined twice", "tools")
        parameters[name] = schema
    mode, named = _choice(choice, parameters)
    return ToolChoice(mode, parameters, named, parallel is not False, list(tools))


def _tool(i: int, tool: Any) -> tuple[str, dict[str, Any]]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(400, f'{where} must be {{"type": "function", "function": {{...}}}}, got {show(tool)}',
                       "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise APIError(400, f"{where}.function must be an object with a name, got {show(function)}", "tools")
    name = function.get("name")
    if not (isinstance(name, str) and _TOOL_NAME.fullmatch(name)):
        raise APIError(400, f"{where}.function.name must be 1-64 letters, digits, _ or -, got {show(name)}",
                       "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(400, f"{where}.function.description must be a string, got {show(description)}", "tools")
    schema = function.get("parameters")
    if schema is None:
        schema = _ANY_OBJECT
    if not isinstance(schema, dict):
        raise APIError(400, f"{where}.function.parameters must be a JSON schema object, got {show(schema)}",
                       "tools")
    return name, schema


def _choice(choice: Any, parameters: dict[str, dict[str, Any]]) -> tuple[ToolMode, str | None]:
    if choice is None:
        return "auto", None
    if choice == "none" or choice == "auto" or choice == "required":  # (`in` would not narrow it)
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                            f'"function": {{"name": ...}}}}, got {show(choice)}', "tool_choice")
    if name not in parameters:
        raise APIError(400, f"tool_choice names function {name!r}, which is not among the tools "
                            f"({', '.join(sorted(parameters))})", "tool_choice")
    return "named", name


def _tool_constraint(tools: ToolChoice | None) -> Constraint | None:
    """required: a JSON array of {name, parameters} calls, each valid for its tool;
    named: that function's arguments object."""
    if tools is None or tools.mode in ("none", "auto"):
        return None
    if tools.mode == "named":
        assert tools.named is not None  # _choice names the function of mode "named"
        return Constraint(_params("tools", json=json.dumps(tools.parameters[tools.named])),
                          f"tools.{tools.named}.parameters")
    defs: dict[str, Any] = {}
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": _rooted(i, schema, defs)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for i, (name, schema) in enumerate(tools.parameters.items())]
    array: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                             "minItems": 1}
    if defs:
        array["$defs"] = defs
    if not tools.parallel:
        array["maxItems"] = 1
    return Constraint(_params("tools", json=json.dumps(array)), "tools")


def _rooted(i: int, schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema to nest in the required-calls array. One with local
    references ("#/$defs/X", "#") would lose its root there, so it moves whole to the
    array's $defs (as tool<i>) and its references are rewritten to point into it."""
    text = json.dumps(schema)
    if '"$ref"' not in text:
        return schema
    root = f"#/$defs/tool{i}"

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else rewrite(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node
    defs[f"tool{i}"] = rewrite(schema)
    return {"$ref": root}

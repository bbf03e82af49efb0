"""A tool: a Python callable the model may call, its arguments described by a JSON schema built from its type hints.

The schema is the one chat templates render (`tools=` in `apply_chat_template`); the same pydantic model checks the
arguments of every call, so a call the schema refuses never reaches the function.
"""

from __future__ import annotations

import dataclasses
import inspect
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any

import pydantic

from drgrpo_jax.errors import ConfigError, ToolArgumentError

__all__ = ["Tool", "import_object", "make_tool"]


@dataclasses.dataclass(frozen=True)
class Tool:
    """A named callable with its description and argument model; `run` checks the arguments, then calls it."""

    name: str
    description: str
    fn: Callable[..., Any]
    arguments: type[pydantic.BaseModel]

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates take in `tools=`."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description,
                             "parameters": _without_titles(self.arguments.model_json_schema())}}

    def checked_arguments(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments as the schema reads them; ToolArgumentError naming the first bad one."""
        try:
            model = self.arguments.model_validate(dict(arguments), strict=False)
        except pydantic.ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "arguments"
            raise ToolArgumentError(f"{self.name}: argument {where}: {first['msg']}") from None
        return {field: getattr(model, field) for field in type(model).model_fields}

    def run(self, arguments: Mapping[str, Any]) -> Any:
        return self.fn(**self.checked_arguments(arguments))


def _without_titles(schema: Any) -> Any:
    """pydantic's schema less its generated `title` keys (noise in every prompt); a property named title stays."""
    if isinstance(schema, list):
        return [_without_titles(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "properties" and isinstance(value, dict):
            out[key] = {name: _without_titles(sub) for name, sub in value.items()}
        elif key != "title":
            out[key] = _without_titles(value)
    return out


def make_tool(fn: Callable[..., Any], *, name: str | None = None, description: str | None = None) -> Tool:
    """A Tool from a function: every parameter needs a type hint (its JSON type); its docstring's first paragraph
    is the description. Describe a parameter with `Annotated[int, pydantic.Field(description=...)]`."""
    if not callable(fn):
        raise TypeError(f"make_tool: {fn!r} is not callable")
    signature = inspect.signature(fn)
    hints = inspect.get_annotations(fn, eval_str=True) if not inspect.isclass(fn) else {}
    fields: dict[str, Any] = {}
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise TypeError(f"make_tool: {fn.__name__}: *args/**kwargs have no JSON schema; name every argument")
        if parameter.name not in hints:
            raise TypeError(f"make_tool: {fn.__name__}: argument {parameter.name!r} needs a type hint "
                            "(its JSON schema type)")
        default = ... if parameter.default is parameter.empty else parameter.default
        fields[parameter.name] = (hints[parameter.name], default)
    tool_name = name or fn.__name__
    doc = inspect.getdoc(fn) or ""
    arguments = pydantic.create_model(f"{tool_name}_arguments", __config__=pydantic.ConfigDict(extra="forbid"),
                                      **fields)
    return Tool(tool_name, description if description is not None else doc.split("\n\n")[0].strip(), fn, arguments)


def import_object(path: str, key: str) -> Any:
    """`package.module:name` -> the object; a ConfigError naming `key` when it cannot be imported."""
    module_name, colon, attribute = path.partition(":")
    if not colon or not module_name or not attribute:
        raise ConfigError(key, f"{path!r} is not 'package.module:name'")
    try:
        return pkgutil.resolve_name(path)
    except AttributeError:
        raise ConfigError(key, f"{module_name!r} has no {attribute!r}") from None
    except Exception as error:  # ImportError or the module's own import-time failure
        raise ConfigError(key, f"cannot import {module_name!r}: {type(error).__name__}: {error}") from None

"""Recipe validation errors a user can act on: `file:line: field: what was expected`, with a suggestion.

pydantic reports where a mistake is as a path of keys (('quant', 'targets', 0, 'scheme')); the YAML node tree
(yaml.compose keeps every node's start mark) turns that path back into the line the user must edit.
"""
from __future__ import annotations

import difflib
import re
import types
import typing

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import UserError

# errors about a key itself (point at the key's line), rather than about its value
_KEY_ERRORS = {"extra_forbidden", "unknown_gate"}


class RecipeError(UserError):
    """One or more recipe mistakes; the message is the first, `problems` holds them all, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        more = f" (and {len(problems) - 1} more; `quantkit recipe validate FILE` lists them all)" \
            if len(problems) > 1 else ""
        super().__init__(problems[0] + more)


def _unwrap(annotation):
    """The model class a field leads into, or the container's element type, for walking an error path."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else annotation
    return annotation


def model_at(root: type[BaseModel], path) -> type[BaseModel] | None:
    """The pydantic model class found by following PATH (field names, list indices, dict keys) from ROOT."""
    cur = root
    for part in path:
        cur = _unwrap(cur)
        origin = typing.get_origin(cur)
        if isinstance(cur, type) and issubclass(cur, BaseModel):
            field = cur.model_fields.get(str(part))
            if field is None:
                return None
            cur = field.annotation
        elif origin in (list, tuple):
            cur = typing.get_args(cur)[0]
        elif origin is dict:
            cur = typing.get_args(cur)[1]
        else:
            return None
    cur = _unwrap(cur)
    return cur if isinstance(cur, type) and issubclass(cur, BaseModel) else None


def _field_path(loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _suggest(word, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ";"


def describe(err: dict, root: type[BaseModel]) -> tuple[str, str]:
    """(dotted field, message saying what was expected) for one pydantic error dict."""
    kind, loc, given = err["type"], tuple(err["loc"]), err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        parent = model_at(root, loc[:-1])
        valid = list(parent.model_fields) if parent else []
        return _field_path(loc), (f"unknown field '{loc[-1]}'{_suggest(loc[-1], valid)}"
                                  + (f" valid fields here: {', '.join(valid)}" if valid else "")).rstrip(";")
    if kind == "unknown_gate":
        key, choices = ctx["key"], ctx["choices"]
        return _field_path(loc + (key,)), f"unknown gate '{key}'{_suggest(key, choices)} gates: {', '.join(choices)}"
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        msg = f"expected one of {', '.join(choices)}, got {given!r}{_suggest(given, choices)}"
        return _field_path(loc), msg.rstrip(";")
    if kind == "missing":
        return _field_path(loc), "required field is missing; add it"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        sub = model_at(root, loc)
        fields = f" ({', '.join(sub.model_fields)})" if sub else ""
        return _field_path(loc), f"expected a mapping of fields{fields}, got {given!r}"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        got = "" if isinstance(given, dict) else f" (got {given!r})"
        return _field_path(loc), msg[len("Value error, "):] + got
    msg = re.sub(r"^Input should be", "expected", msg)
    return _field_path(loc), f"{msg}; got {given!r}"


def _locate(root: yaml.Node, loc, on_key: bool) -> int:
    """1-based line of the YAML node at LOC (the key's line when ON_KEY), or of the deepest node that exists."""
    node, line = root, root.start_mark.line
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            hit = next(((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(part)), None)
            if hit is None:
                break
            key, node = hit
            line = key.start_mark.line if on_key else node.start_mark.line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line
        else:
            break
    return line + 1


def _duplicates(node: yaml.Node, source: str, path=()) -> list[str]:
    """safe_load keeps the last of two equal keys silently; a recipe with both is almost surely a mistake."""
    out = []
    if isinstance(node, yaml.MappingNode):
        seen = {}
        for k, v in node.value:
            name = k.value if isinstance(k, yaml.ScalarNode) else None
            if name in seen:
                out.append(f"{source}:{k.start_mark.line + 1}: {_field_path(path + (name,))}: given twice "
                           f"(first on line {seen[name] + 1}); keep one")
            elif name is not None:
                seen[name] = k.start_mark.line
            out += _duplicates(v, source, path + (name,))
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out += _duplicates(v, source, path + (i,))
    return out


def validate_yaml(text: str, source: str, root: type[BaseModel]):
    """(model instance or None, [problems]): parse TEXT as YAML and validate it against ROOT."""
    from .yaml_bounds import yaml_limit_problem

    problem = yaml_limit_problem(text, source)  # before anything builds the text: aliases, depth, huge numbers
    if problem:
        return None, [problem]
    try:
        tree = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}:{mark.line + 1}" if mark else source
        what = " ".join(x for x in (e.context, e.problem) if x)
        return None, [f"{where}: not valid YAML: {what}; check the indentation and quoting there"]
    except yaml.YAMLError as e:
        return None, [f"{source}: not valid YAML: {str(e).splitlines()[0]}"]
    if tree is None:  # an empty file: every field at its default
        tree, data = yaml.compose("{}"), {}
    if not isinstance(data, dict):
        return None, [f"{source}:{tree.start_mark.line + 1}: expected a mapping of recipe fields "
                      f"({', '.join(root.model_fields)}), got a {type(data).__name__}"]
    problems = _duplicates(tree, source)
    if problems:
        return None, problems
    try:
        return root.model_validate(data), []
    except ValidationError as e:
        out = []  # (line, message): reported in file order, not pydantic's field order
        for err in e.errors():
            field, msg = describe(err, root)
            line = _locate(tree, tuple(err["loc"]), err["type"] in _KEY_ERRORS)
            if err["type"] == "unknown_gate":
                line = _locate(tree, tuple(err["loc"]) + (err["ctx"]["key"],), True)
            out.append((line, f"{source}:{line}: {field}: {msg}"))
        return None, [m for _, m in sorted(out, key=lambda x: x[0])]

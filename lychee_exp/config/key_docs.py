"""What each config key means, for a command's `--help`: the comment beside (or just above) its field in the typed
schema (config.schema, config.commands), read from the source, so that the schema's comments stay the one place a
key is documented. A key declared in another schema (rules.declared_in) without a comment of its own reads its
owner's."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from typing import Any, Iterator

from lychee_exp.config.rules import DECLARED_IN

# comments that are for tools, not readers
PRAGMAS = ("fmt:", "type:", "noqa", "pragma:")


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted, as an override names it (model.lora.r)
    comment: str  # "" where the schema says nothing
    nested: bool  # a group of keys (model, dense): its own keys follow


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """field name -> its comment in cls's source: the comment lines right above the field, then the one on its
    line(s), joined; pragmas (`# fmt: skip`, `# type: ...`) left out."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):  # no source (a frozen or generated class): keys without comments
        return {}
    source = textwrap.dedent("".join(lines))
    own_line: dict[int, str] = {}  # line -> a comment alone on its line
    trailing: dict[int, str] = {}  # line -> a comment after code
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        text = token.string.lstrip("#").strip()
        if text.startswith(PRAGMAS):
            continue
        alone = not token.line[: token.start[1]].strip()
        (own_line if alone else trailing)[token.start[0]] = text
    comments = {}
    for node in ast.parse(source).body[0].body:  # the class's statements
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line in own_line:
            above.insert(0, own_line[line])
            line -= 1
        beside = [trailing[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in trailing]
        comments[node.target.id] = " ".join(above + beside)
    return comments


def key_comment(cls: type, field: dataclasses.Field) -> str:
    """A field's comment; a shared key's (declared_in) from its owner's source where it has none here."""
    own = field_comments(cls).get(field.name, "")
    if own or DECLARED_IN not in field.metadata:
        return own
    owner_name, name = field.metadata[DECLARED_IN].split(".")
    owner = vars(sys.modules[cls.__module__]).get(owner_name)
    if owner is None or not dataclasses.is_dataclass(owner):
        return ""
    return key_comment(owner, next(f for f in dataclasses.fields(owner) if f.name == name))


def key_docs(schema: type, prefix: str = "") -> Iterator[KeyDoc]:
    """Every key of a schema dataclass, in declaration order, nested groups' keys after their group's line."""
    hints = typing.get_type_hints(schema, vars(sys.modules[schema.__module__]))
    for field in dataclasses.fields(schema):
        kind = _dataclass_of(hints.get(field.name))
        key = f"{prefix}{field.name}"
        yield KeyDoc(key, key_comment(schema, field), kind is not None)
        if kind is not None:
            yield from key_docs(kind, f"{key}.")


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass a field holds (Optional[X] included), else None."""
    if dataclasses.is_dataclass(hint):
        return hint  # type: ignore[return-value]
    found = [arg for arg in typing.get_args(hint) if dataclasses.is_dataclass(arg)]
    return found[0] if found else None

"""The one reader of a user's YAML file (a study): bounded, and naming the file and line of what it refuses.

PyYAML's safe loader still expands anchors and aliases, so a "billion laughs" file of a few lines (nine levels
of ``&x [*y, *y, ...]``) grows without bound once walked, and ``&a [*a]`` is a cycle; it also keeps the last
of two equal keys silently. :func:`read_yaml` refuses all three, and nesting deeper than :data:`MAX_DEPTH`
and files larger than :data:`MAX_BYTES`, so that what it returns is a tree at most as large as the file's text.

Anchors and aliases are refused outright rather than expanded up to a cap: no committed study uses them, a
capped expansion would still let a file of a few lines stand for a large tree, and an error that says
"write the value out" is simple to act on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from quantgate.errors import InputError
from quantgate.files import read_text, short_repr

__all__ = ["read_yaml", "yaml_text", "MAX_DEPTH", "MAX_BYTES"]

MAX_DEPTH = 64  # nested mappings and lists; a study file uses fewer than 10
MAX_BYTES = 1 << 20  # a study file is a few kilobytes

Lines = dict[tuple, int]  # key path (keys and list indices) -> its 1-based line


class _Refused(Exception):
    """What the reader refuses, at a 1-based line."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line, self.message = line, message


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses an anchor or alias, and nesting deeper than MAX_DEPTH, as it composes."""

    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        line = event.start_mark.line + 1 if event.start_mark is not None else self.line + 1
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            mark = "*" if isinstance(event, yaml.AliasEvent) else "&"
            raise _Refused(
                line,
                f"YAML anchors and aliases ({mark}{event.anchor}) are not read here (one can stand for a tree "
                f"of any size, or for itself): write the value out",
            )
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise _Refused(line, f"lists and mappings nested more than {MAX_DEPTH} levels")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1
        return super().compose_node(parent, index)


class _TreeDumper(yaml.SafeDumper):
    """PyYAML's safe dumper writing a value shared by two places out twice, never as an anchor and alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def yaml_text(data: Any) -> str:
    """``data`` as YAML that :func:`read_yaml` reads back: keys in their order, no anchors or aliases (PyYAML's
    dumper writes an object met twice as ``&id001`` and ``*id001``, which :func:`read_yaml` refuses)."""
    return yaml.dump(data, Dumper=_TreeDumper, sort_keys=False)


def read_yaml(path: str | Path, text: str | None = None) -> tuple[Any, Lines]:
    """The data of the YAML file ``path`` (or of ``text``, named ``path``) and the line of each value, by key
    path: ``{(): 1, ("models",): 3, ("models", 0): 4, ("models", 0, "name"): 4, ...}``. Refused, with a
    one-line InputError ``<path>:<line>: <why>``: anchors and aliases, a key given twice in a mapping, a key
    that is not a plain value, nesting deeper than :data:`MAX_DEPTH`, a file larger than :data:`MAX_BYTES`,
    invalid YAML, more than one document, a scalar its tag cannot read (``2020-13-45``, ``!!int abc``). An empty
    file is ``{}``."""
    if text is None:
        try:
            text = read_text(path, MAX_BYTES)
        except InputError as e:
            raise InputError(f"{path}: {e}") from None
    elif len(text) > MAX_BYTES:
        raise InputError(f"{path}: larger than {MAX_BYTES:,} characters, the most read from YAML here")
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        data, lines = _walk(node) if node is not None else ({}, {(): 1})
    except _Refused as e:
        raise InputError(f"{path}:{e.line}: {e.message}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f":{mark.line + 1}" if mark is not None else ""
        why = " ".join(str(x) for x in (e.context, e.problem) if x)
        raise InputError(f"{path}{where}: not valid YAML: {why}") from None
    except yaml.YAMLError as e:
        raise InputError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    finally:
        loader.dispose()
    return data, lines


def _walk(root: yaml.Node) -> tuple[Any, Lines]:
    """A composed node tree (no aliases: a tree, not a graph) as Python data, and each value's line."""
    lines: Lines = {}
    scalars = yaml.SafeLoader("")

    def walk(n: yaml.Node, where: tuple) -> Any:
        lines[where] = n.start_mark.line + 1
        if isinstance(n, yaml.MappingNode):
            out: dict[Any, Any] = {}
            key_lines: dict[str, int] = {}
            for k, v in n.value:
                line = k.start_mark.line + 1
                if not isinstance(k, yaml.ScalarNode):
                    raise _Refused(line, "a key must be a plain value, not a list or mapping")
                if k.value in key_lines:
                    raise _Refused(
                        line, f"key {k.value!r} is given twice (first at line {key_lines[k.value]}): give it once"
                    )
                key_lines[k.value] = line
                out[k.value] = walk(v, (*where, k.value))
            return out
        if isinstance(n, yaml.SequenceNode):
            return [walk(v, (*where, i)) for i, v in enumerate(n.value)]
        try:
            return scalars.construct_object(n)
        except (ValueError, KeyError) as e:  # PyYAML's int, float, date or bool of a scalar that is none
            why = f" ({e})" if isinstance(e, ValueError) else ""
            kind = n.tag.rpartition(":")[2]
            raise _Refused(lines[where], f"{short_repr(n.value)} is no {kind}{why}; quote it for text") from None

    return walk(root, ()), lines

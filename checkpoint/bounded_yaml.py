"""YAML read with limits: size, depth, aliases and expanded nodes (shared by the job, tolerances, profiles).

PyYAML's safe loader builds no objects but plain data, yet two inputs still hurt: an alias bomb (a few
lines whose anchors expand to billions of nodes, which every later walk of the data expands again) and
nesting deep enough to exhaust the recursion limit. `load` parses the events first (no recursion, no
objects), refusing more than `max_depth` levels or `max_aliases` aliases, then composes the node graph
and refuses more than `max_nodes` nodes once aliases are expanded, and only then constructs the data.
Like `checkpoint.layout`, a piece of shared vocabulary: the three libraries and `migrate` use it.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_BYTES = 1 << 20  # job files, tolerances, profiles and model configs are a few KiB
MAX_DEPTH = 64
MAX_ALIASES = 256
MAX_NODES = 200_000


class YamlInputError(ValueError):
    """A YAML document that is malformed or over a limit; the message names the place and the limit."""


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping."""


def _construct_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:  # an unhashable key (a list or mapping used as a key)
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is not a plain value",
                                                    key_node.start_mark) from None
        if duplicate:
            first = seen[key].start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice (first at line {first.line + 1})", key_node.start_mark)
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _where(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""


def _expanded_nodes(root: yaml.Node, limit: int) -> int:
    """Nodes of the graph with every alias expanded (memoized per node, so linear in the graph); stops past
    `limit`."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else \
            list(node.value) if isinstance(node, yaml.SequenceNode) else []
        if not done:
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            continue
        sizes[id(node)] = min(limit + 1, 1 + sum(sizes[id(c)] for c in children))
    return sizes[id(root)]


def load(text: str, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH, max_aliases: int = MAX_ALIASES,
         max_nodes: int = MAX_NODES) -> Any:
    """The data of one YAML document (None for an empty one), duplicate keys refused; raises YamlInputError
    naming the line and the limit for malformed input, a document over `max_bytes` bytes, deeper than
    `max_depth`, with more than `max_aliases` aliases or more than `max_nodes` nodes once they are expanded."""
    size = len(text.encode("utf-8", "replace"))
    if size > max_bytes:
        raise YamlInputError(f"{size} bytes, over the limit of {max_bytes} for a configuration file")
    try:
        depth = aliases = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > max_depth:
                    raise YamlInputError(f"{_where(event.start_mark)}nested deeper than {max_depth} levels")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
            elif isinstance(event, yaml.AliasEvent):
                aliases += 1
                if aliases > max_aliases:
                    raise YamlInputError(f"{_where(event.start_mark)}more than {max_aliases} aliases (*name); "
                                         f"an alias bomb?")
        loader = UniqueKeyLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            nodes = _expanded_nodes(node, max_nodes)
            if nodes > max_nodes:
                raise YamlInputError(f"expands to more than {max_nodes} nodes once its aliases are resolved "
                                     f"(an alias bomb?)")
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise YamlInputError(f"invalid YAML at {_where(mark)}{problem}") from None
    except RecursionError:
        raise YamlInputError(f"nested too deeply to read (limit {max_depth} levels)") from None

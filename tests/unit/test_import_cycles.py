"""No import cycle among the product's modules: every `import` and `from ... import` in migrate/, checkpoint/,
parallel_search/ and convergence/ (at module level, inside functions and under TYPE_CHECKING alike) is an edge,
and the graph has no strongly connected component larger than one module."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("migrate", "checkpoint", "parallel_search", "convergence")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules `name` imports (a name imported from a package counts as its submodule when
    there is one)."""
    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [known(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base) for a in node.names]
        else:
            continue
        out |= {t for t in targets if t and t != name}
    return out


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_product_has_no_import_cycle():
    modules = _modules()
    assert len(modules) > 150
    edges = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(edges) == []


def test_the_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _private_uses(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """`module._name` and `from module import _name` in `name`'s source where `module` is another product module
    (a private name used across modules: a helper that should be public, or not used there)."""
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {(a.asname or a.name): a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules:
                    aliases[a.asname or a.name] = full
                elif node.module in modules and a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{name}: from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr.startswith("_") and not node.attr.startswith("__") and aliases[node.value.id] != name:
            found.append(f"{name}: {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    modules = _modules()
    found = [use for name, path in modules.items() for use in _private_uses(name, path, modules)]
    assert found == []


def test_the_private_name_check_finds_both_spellings(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from pkg import other as o\nfrom pkg.other import _helper, public\nx = o._state(1)\n")
    modules = {"pkg.m": source, "pkg.other": source}
    assert _private_uses("pkg.m", source, modules) == ["pkg.m: from pkg.other import _helper",
                                                       "pkg.m: pkg.other._state"]

"""Write docs/job-reference.md, the job file reference, from the code that validates job files: every section
and key of the job (`migrate.job.schema.JobSpec`), every stage's options (`migrate.stages.STAGES`) and every key
of the gate's tolerances file (`convergence.tolerances.Tolerances`), each with its type, default and the
contract its code states.

    python scripts/job_reference.py           # (re)write docs/job-reference.md
    python scripts/job_reference.py --check   # exit 1 when the committed file is not what the code says
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "docs" / "job-reference.md"


def attribute_docs(cls: type) -> dict[str, str]:
    """{field: the string literal that follows it in the class body}; consecutive fields before one string
    share it (how `DecisionRule` documents its shares)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__ in ("builtins", "pydantic.main"):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        pending: list[str] = []
        for node in tree.body[0].body:  # type: ignore[attr-defined]
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                pending.append(node.target.id)
            elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                  and isinstance(node.value.value, str)):
                for name in pending:
                    docs[name] = " ".join(node.value.value.split())
                pending = []
            else:
                pending = []
    return docs


def type_name(annotation: Any) -> str:
    """A reader's spelling of a type: `int | None`, `'cosine' | 'linear'`, `list of CustomOperator`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0]) + bounds_text(args[1:])
    if origin in (tuple, list):
        inner = [a for a in args if a is not Ellipsis]
        return f"list of {type_name(inner[0])}" if inner else "list"
    if origin is dict:
        return f"mapping {type_name(args[0])} -> {type_name(args[1])}" if args else "mapping"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(repr(m.value) for m in annotation)
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def bounds_text(metadata: Any) -> str:
    """` > 0`, ` >= 1, <= 1` from annotated-types constraints; empty without any."""
    signs = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    bounds = [f"{signs[k]} {getattr(m, k)}" for m in metadata for k in signs if getattr(m, k, None) is not None]
    return f" ({', '.join(bounds)})" if bounds else ""


def default_text(value: Any) -> str:
    if value is PydanticUndefined or value is dataclasses.MISSING:
        return "**required**"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, BaseModel):
        return "(its keys below)"
    if isinstance(value, tuple):
        value = list(value)
    text = repr(value)
    return f"`{text}`" if len(text) <= 60 else f"`{text[:57]}...`"


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (directly, in a list or in an Optional)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models_in(a)]


def model_rows(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every field of `model`, nested models under dotted keys."""
    docs = attribute_docs(model)
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        default = info.default_factory() if info.default_factory is not None else info.default
        inner = _models_in(info.annotation)
        meaning = info.description or docs.get(name, "") or ((inner[0].__doc__ or "").strip().split("\n")[0] if inner else "")
        yield key, type_name(info.annotation) + bounds_text(info.metadata), default_text(default), meaning
        for sub in inner:
            list_like = typing.get_origin(info.annotation) in (list, tuple) or any(
                typing.get_origin(a) in (list, tuple) for a in typing.get_args(info.annotation))
            nested.append((f"{key}[]." if list_like else f"{key}.", sub))
    for sub_prefix, sub in nested:
        yield from model_rows(sub, sub_prefix)


def dataclass_rows(cls: type, prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    docs = attribute_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):  # type: ignore[arg-type]
            yield from dataclass_rows(f.default_factory, f"{prefix}{f.name}.")  # type: ignore[arg-type]
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        yield f"{prefix}{f.name}", type_name(hints[f.name]), default_text(default), docs.get(f.name, "")


def table(rows: Iterator[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, kind, default, meaning in rows:
        escaped = meaning.replace("|", "\\|")
        lines.append(f"| `{key}` | {kind} | {default} | {escaped} |")
    return lines


def render() -> str:
    from convergence.tolerances import Tolerances
    from migrate.job.schema import JobSpec
    from migrate.stages import STAGES

    lines = ["# Job file reference", "",
             "Written by `scripts/job_reference.py` from the code that validates job files (a test fails when "
             "this file and the code disagree). A job is YAML; unknown keys are errors; relative paths are "
             "relative to the job file.", "", "## Sections", ""]
    lines += table(row for row in model_rows(JobSpec) if not row[0].startswith("stages."))
    lines += ["", "## Stages", "",
              "`stages:` maps each stage to run to its options (`{}` or nothing for the defaults). The checklist "
              "order is " + ", ".join(f"`{name}`" for name in STAGES) + "; a stage runs after the stages it "
              "uses.", ""]
    for name, stage in STAGES.items():
        lines += [f"### `{name}`", "", stage.description[:1].upper() + stage.description[1:] + "."]
        needs = [f"needs {', '.join(f'`{d}`' for d in stage.depends_on)}" if stage.depends_on else "",
                 f"uses {', '.join(f'`{a}`' for a in stage.after)} when the job lists it" if stage.after else ""]
        if any(needs):
            lines.append("It " + " and ".join(n for n in needs if n) + ".")
        rows = list(model_rows(stage.options))
        lines += [""] + (table(iter(rows)) if rows else ["No options."]) + [""]
    lines += ["## Gate tolerances", "",
              "The gate stage's `tolerances` (inline) or `tolerances_file` (YAML), and `migrate gate --tolerances "
              "FILE`, take these keys; any key left out keeps its default.", ""]
    lines += table(dataclass_rows(Tolerances)) + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed file, write nothing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.is_file() else ""
        if current != text:
            print(f"{OUTPUT} is out of date: run python scripts/job_reference.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Read a job file into a validated ``Job``, or fail with every problem named.

``load_job(path)`` parses YAML (duplicate keys are errors), validates the schema and
each listed stage's options, and resolves paths relative to the job file. On any
problem it raises ``JobError`` listing each one as ``field: message (got value)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from pydantic import BaseModel, ValidationError

from checkpoint import bounded_yaml
from migrate.job.job import Job
from migrate.job.schema import JobSpec

__all__ = ["Job", "JobError", "Problem", "deprecations", "load_job", "parse_job"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a job file."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class JobError(ValueError):
    """A job file that cannot run; ``problems`` lists every reason."""

    def __init__(self, path: Path | str, problems: list[Problem]):
        self.path = Path(path)
        self.problems = tuple(problems)
        if len(self.problems) == 1:  # one line: the file, the field, what is wrong
            super().__init__(f"{self.path}: {self.problems[0]} (nothing was run)")
            return
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{self.path}: {len(self.problems)} problem(s), nothing was run:\n{body}")


def _field_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def _allowed_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names allowed at ``loc`` (the parent of an unknown key), best effort."""
    current: Any = model
    for item in loc:
        if isinstance(item, int) or not (isinstance(current, type) and issubclass(current, BaseModel)):
            continue
        field = current.model_fields.get(item)
        if field is None:
            return []
        annotation = field.annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return []
        current = nested[0]
    return sorted(current.model_fields) if isinstance(current, type) and issubclass(current, BaseModel) else []


def problems_from_validation(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> list[Problem]:
    """Turn pydantic's errors into ``field: message (got value)`` problems."""
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(x for x in err["loc"] if not (isinstance(x, str) and ("[" in x or x.startswith("function-"))))
        field = _field_path(loc)
        if prefix:
            field = f"{prefix}.{field}" if field else prefix
        kind = err["type"]
        if kind == "extra_forbidden":
            allowed = _allowed_fields(model, loc[:-1])
            message = "unknown field" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
        elif kind == "missing":
            message = "required field is missing"
        else:
            message = err["msg"].removeprefix("Value error, ")
            if "input" in err and kind not in ("value_error", "assertion_error") and not isinstance(err["input"], dict):
                message += f" (got {err['input']!r})"
        problems.append(Problem(field, message))
    return problems


def parse_job(data: Any, path: Path | str) -> Job:
    """Validate already-parsed YAML data as a job read from ``path``."""
    from migrate.stages import STAGES, stage_order_problems

    path = Path(path).resolve()
    if not isinstance(data, dict):
        raise JobError(path, [Problem("", f"the file must hold a mapping of sections, got {type(data).__name__}")])
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise JobError(path, problems_from_validation(exc, JobSpec)) from None
    problems: list[Problem] = []
    options: dict[str, BaseModel] = {}
    for name, raw in spec.stages.items():
        stage = STAGES.get(name)
        if stage is None:
            problems.append(Problem(f"stages.{name}", f"unknown stage; allowed: {', '.join(STAGES)}"))
            continue
        try:
            options[name] = stage.options.model_validate(raw or {})
        except ValidationError as exc:
            problems += problems_from_validation(exc, stage.options, prefix=f"stages.{name}")
    problems += [Problem("stages", msg) for msg in stage_order_problems(tuple(spec.stages))]
    if problems:
        raise JobError(path, problems)
    work_dir = Path(spec.work_dir.format(name=spec.name)).expanduser()
    if not work_dir.is_absolute():
        work_dir = (path.parent / work_dir).resolve()
    if RAY_WORKING_COPY in str(work_dir):
        raise JobError(path, [Problem("work_dir", f"{spec.work_dir!r} resolves to {work_dir}, inside Ray's temporary "
                                                  f"copy of the job's working dir, which Ray deletes when the job ends "
                                                  f"(results lost, nothing to skip on a rerun); set work_dir to an "
                                                  f"absolute path (shared storage on a multi-node cluster)")])
    return Job(spec=spec, path=path, work_dir=work_dir, stage_options=options, deprecations=deprecations(data))


def deprecations(data: Mapping[str, Any]) -> tuple[str, ...]:
    """`field: 'old' is deprecated, use 'new'` for each earlier spelling the raw job uses (pure)."""
    from checkpoint.formats import FORMAT_ALIASES

    found = []
    checkpoint = (data.get("source") or {}).get("checkpoint") or {}
    if isinstance(checkpoint, Mapping) and checkpoint.get("format") in FORMAT_ALIASES:
        found.append(("source.checkpoint.format", checkpoint["format"], FORMAT_ALIASES[checkpoint["format"]]))
    convert = (data.get("stages") or {}).get("convert") or {}
    if isinstance(convert, Mapping) and convert.get("to_format") in FORMAT_ALIASES:
        found.append(("stages.convert.to_format", convert["to_format"], FORMAT_ALIASES[convert["to_format"]]))
    comm = (data.get("stages") or {}).get("comm") or {}
    if isinstance(comm, Mapping):
        from migrate.comm.matrix import SHORT_NAMES

        torch_names = {v: k for k, v in SHORT_NAMES.items()}
        dtypes = comm.get("dtypes") if isinstance(comm.get("dtypes"), (list, tuple)) else None
        dtypes = dtypes or ()
        found += [("stages.comm.dtypes", d, torch_names[d]) for d in dtypes if d in torch_names]
        if comm.get("bandwidth_dtype") in torch_names:
            found.append(("stages.comm.bandwidth_dtype", comm["bandwidth_dtype"], torch_names[comm["bandwidth_dtype"]]))
    return tuple(f"{field}: {old!r} is deprecated, use {new!r} (accepted until migrate 0.3)" for field, old, new in found)


RAY_WORKING_COPY = "/runtime_resources/working_dir_files/"  # where `ray job submit --working-dir` unpacks a job


def load_job(path: Path | str) -> Job:
    """Read and validate a job file; raise ``JobError`` naming every problem."""
    path = Path(path)
    try:
        if path.is_file() and path.stat().st_size > bounded_yaml.MAX_BYTES:
            raise JobError(path, [Problem("", f"{path.stat().st_size} bytes, over the limit of "
                                              f"{bounded_yaml.MAX_BYTES} for a job file")])
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobError(path, [Problem("", "file not found")]) from None
    except (IsADirectoryError, UnicodeDecodeError, PermissionError) as exc:
        raise JobError(path, [Problem("", f"not a readable YAML text file: {exc}")]) from None
    try:
        data = bounded_yaml.load(text)
    except bounded_yaml.YamlInputError as exc:
        raise JobError(path, [Problem("", str(exc))]) from None
    if data is None:
        raise JobError(path, [Problem("", "the file is empty")])
    return parse_job(data, path)

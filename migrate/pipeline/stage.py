"""What a stage is, what it is given, and what it leaves behind.

A stage module defines ``STAGE = StageDefinition(...)``. The runner gives its ``run``
a ``StageContext`` and turns the returned ``StageOutcome`` into a ``StageArtifact``
written as ``<work_dir>/<stage>/result.json`` (machine-readable) and ``summary.md``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from migrate.job.job import Job
    from migrate.runtime.worker_group import WorkerGroup

T = TypeVar("T")
Verdict = Literal["pass", "fail", "done"]
ARTIFACT_VERSION = 1


class StageOptions(BaseModel):
    """Base of a stage's options: frozen, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class StageStatus(str, Enum):
    """Where a stage ended; ``ok`` says whether dependents may use its result."""

    SUCCEEDED = "succeeded"
    SKIPPED = "skipped"  # unchanged inputs: the previous successful artifact stands
    FAILED = "failed"  # raised, or returned verdict "fail"
    BLOCKED = "blocked"  # a dependency did not succeed

    @property
    def ok(self) -> bool:
        return self in (StageStatus.SUCCEEDED, StageStatus.SKIPPED)


@dataclass(frozen=True, kw_only=True)
class StageOutcome:
    """What a stage's ``run`` returns."""

    verdict: Verdict = "done"
    metrics: Mapping[str, Any] = field(default_factory=dict)
    outputs: Mapping[str, str] = field(default_factory=dict)  # name -> path (relative to work_dir or absolute)
    reasons: tuple[str, ...] = ()
    summary_md: str = ""


@dataclass(frozen=True, kw_only=True)
class StageArtifact:
    """The JSON record a stage leaves: inputs hash, outputs, metrics, verdict, timings."""

    stage: str
    status: StageStatus
    verdict: Verdict | None
    input_hash: str
    inputs: Mapping[str, Any]
    outputs: Mapping[str, str]
    metrics: Mapping[str, Any]
    reasons: tuple[str, ...]
    started_at: str
    finished_at: str
    duration_s: float
    error: str = ""
    version: int = ARTIFACT_VERSION

    def to_json(self) -> str:
        data = asdict(self)
        data["status"] = self.status.value
        return json.dumps(data, indent=2, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str) -> StageArtifact:
        data = json.loads(text)
        data["status"] = StageStatus(data["status"])
        data["reasons"] = tuple(data.get("reasons", ()))
        return cls(**data)

    @property
    def result_digest(self) -> str:
        """What dependents hash: changes whenever this stage's inputs or results change."""
        import hashlib

        body = json.dumps({"in": self.input_hash, "out": dict(self.outputs), "verdict": self.verdict}, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()


class StageTracker(Protocol):
    """What a stage may log (`migrate.tracking.tracker.Tracker` is the real one)."""

    def log_metrics(self, step: int, metrics: Mapping[str, Any], *, prefix: str, side: str | None = None) -> None: ...

    def log_table(self, stage: str, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None: ...


@dataclass(frozen=True)
class StageContext:
    """Everything a stage may use: the job, its options, its folder, upstream results, effects."""

    job: Job
    options: BaseModel
    work_dir: Path
    upstream: Mapping[str, StageArtifact]
    tracker: StageTracker
    start_group: Callable[..., WorkerGroup]
    stage: str
    status: Callable[..., None] = field(default=lambda *args, **kwargs: None)
    """What the stage is doing now, for a live status line (`migrate.progress.LiveStatus`); None: quiet."""

    def worker_group(self, **overrides: Any) -> WorkerGroup:
        """Start a worker group on the job's target (``overrides`` change spec fields)."""
        world = overrides.get("world_size")
        self.status(f"starting {world} rank(s)" if world else "starting the worker group")
        group = self.start_group(**overrides)
        self.status(f"running on {group.spec.world_size} rank(s)")
        return group

    def progress(self, items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
        """Iterate with a progress bar on stderr."""
        from tqdm import tqdm

        yield from tqdm(items, desc=f"[{self.stage}] {desc}", total=total, leave=False, dynamic_ncols=True)

    def log_metrics(self, step: int, metrics: Mapping[str, Any], *, side: str | None = None) -> None:
        """One step of this stage's series (of `side`, baseline or target, where the stage runs both)."""
        self.tracker.log_metrics(step, metrics, prefix=self.stage, **({"side": side} if side else {}))


@dataclass(frozen=True, kw_only=True)
class StageDefinition:
    """A checklist stage: its name, what it needs, its options and the function that runs it.

    ``depends_on`` stages must be in the job and succeed first; ``after`` stages are used
    when the job lists them (run first, their results hashed, a failure blocks this one)
    and ignored otherwise. ``reads`` names the job sections that are inputs of the stage
    (hashed for the skip decision); ``fingerprint`` adds inputs outside the job file (e.g. a checkpoint's
    files); ``version`` changes whenever the stage's logic changes its results.
    """

    name: str
    description: str
    run: Callable[[StageContext], StageOutcome]
    options: type[BaseModel] = StageOptions
    depends_on: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    reads: tuple[str, ...] = ("source", "target", "model", "training")
    fingerprint: Callable[[Job, BaseModel], Mapping[str, Any]] | None = None
    version: str = "1"
    uses: Callable[[BaseModel], tuple[str, ...]] | None = None  # which ``after`` stages these options use (default: all)
    artifact_key: Callable[[BaseModel], str] | None = None
    """Where these options' result is kept, under the work dir (default: the stage's name); e.g. the train
    stage's target side beside its baseline, which dependents use."""

    def key(self, options: BaseModel | None) -> str:
        return self.name if self.artifact_key is None or options is None else self.artifact_key(options)

    def upstream_in(self, listed: tuple[str, ...] | list[str], options: BaseModel | None = None) -> tuple[str, ...]:
        """The stages whose results this one uses in a job listing ``listed`` (with these options)."""
        after = self.after if self.uses is None or options is None else tuple(s for s in self.after if s in self.uses(options))
        return self.depends_on + tuple(s for s in after if s in listed and s not in self.depends_on)

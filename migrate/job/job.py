"""A validated job (what `migrate.job.load` returns): its spec, where it came from, its stages' options."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping

from pydantic import BaseModel

from migrate.job.schema import JobSpec


@dataclass(frozen=True)
class Job:
    """A validated job: the spec, where it came from, and each stage's options."""

    spec: JobSpec
    path: Path
    work_dir: Path
    stage_options: Mapping[str, BaseModel]
    deprecations: tuple[str, ...] = ()  # earlier spellings the file uses, each with its current one

    @property
    def name(self) -> str:
        return self.spec.name

    def resolve(self, path: str) -> Path:
        """A path from the job file, relative to the job file's folder."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else (self.path.parent / p).resolve()

    def section_digest(self, *sections: str) -> str:
        """A stable hash of the named top-level sections (inputs of a stage)."""
        data = self.spec.model_dump(mode="json")
        chosen = {name: data[name] for name in sections}
        return hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()

"""The gate's verdict: pass/fail, the failing reason codes, every check, band provenance."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from convergence.calibration import Bands
from convergence.checks import CheckResult

VERDICT_VERSION = 2  # 2: the decision rule (`rule`) and window tests


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Verdict:
    passed: bool
    checks: tuple[CheckResult, ...]
    candidate: str
    baselines: tuple[str, ...]
    align_by: str
    loss_bands: Bands | None = None
    grad_norm_bands: Bands | None = None
    candidate_loss: np.ndarray | None = None
    candidate_grad_norm: np.ndarray | None = None
    baseline_loss: np.ndarray | None = None
    baseline_grad_norm: np.ndarray | None = None
    tolerances: Mapping[str, Any] = field(default_factory=dict)
    rule: tuple[str, ...] = ()
    """The decision rule in words, one line per metric: level, comparisons, where the scales came from."""
    alignment: tuple[str, ...] = ()
    """How the logs were read and aligned: restarts, replayed and duplicated steps, intervals, policies."""

    @property
    def failed_codes(self) -> tuple[str, ...]:
        """Distinct codes of the failing checks, in check order."""
        return tuple(dict.fromkeys(c.code for c in self.checks if not c.passed))

    @property
    def reasons(self) -> tuple[str, ...]:
        return tuple(f"{c.code}: {c.reason}" for c in self.checks if not c.passed)

    def to_dict(self) -> dict[str, Any]:
        bands = {}
        for b in (self.loss_bands, self.grad_norm_bands):
            if b is not None:
                bands[b.metric] = {"rule": b.rule, "sources": b.provenance(), "calibrated": b.calibrated}
        return {
            "version": VERDICT_VERSION,
            "verdict": "pass" if self.passed else "fail",
            "failed": list(self.failed_codes),
            "reasons": list(self.reasons),
            "candidate": self.candidate,
            "baselines": list(self.baselines),
            "align_by": self.align_by,
            "bands": bands,
            "rule": list(self.rule),
            "alignment": list(self.alignment),
            "checks": [c.to_dict() for c in self.checks],
            "tolerances": dict(self.tolerances),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_default, allow_nan=False)


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value) if np.isfinite(value) else str(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)

"""The comm result file and its renderings: JSON (the file a later run compares against), CSV, Markdown, PNG.

A :class:`CommResult` holds one cluster's matrix, fallback measurements,
fallback choices, bandwidth rows and option mapping.  ``write_json`` /
``read_json`` round-trip it exactly; ``FORMAT`` is checked on read so that a
file from another tool or version fails with a message naming the file.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

from migrate.comm.bandwidth import BandwidthRow
from migrate.comm.fallbacks import FallbackChoice, FallbackResult
from migrate.comm.matrix import CommMatrix, MatrixCell

FORMAT = "migrate.comm.result/1"


@dataclass(frozen=True, kw_only=True, slots=True)
class CommResult:
    """Everything ``migrate comm`` measured on one cluster."""

    backend: str
    device_type: str
    world_size: int
    torch_version: str
    nodes: tuple[str, ...] = ()
    matrix: CommMatrix | None = None
    fallbacks: tuple[FallbackResult, ...] = ()
    fallback_choices: tuple[FallbackChoice, ...] = ()
    bandwidth: tuple[BandwidthRow, ...] = ()
    option_mapping: tuple[Mapping[str, Any], ...] = ()
    created_at: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


def _num(value: Any) -> Any:
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    return value


def to_json_dict(result: CommResult) -> dict[str, Any]:
    """Plain JSON-able dict with the format tag first."""
    return {"format": FORMAT, **_plain(result)}


def from_json_dict(data: Mapping[str, Any], source: str = "<dict>") -> CommResult:
    """Inverse of :func:`to_json_dict`; ValueError naming ``source`` on a wrong format or field."""
    if data.get("format") != FORMAT:
        raise ValueError(f"{source}: format is {data.get('format')!r}, expected {FORMAT!r}")
    try:
        matrix = None
        if data.get("matrix") is not None:
            m = data["matrix"]
            cells = tuple(MatrixCell(**{**c, "wrong_ranks": tuple(c["wrong_ranks"]),
                                        "error_ranks": tuple(c["error_ranks"]),
                                        "max_abs_err": _num(c["max_abs_err"])}) for c in m["cells"])
            matrix = CommMatrix(backend=m["backend"], device_type=m["device_type"], world_size=m["world_size"],
                                torch_version=m["torch_version"], cells=cells)
        return CommResult(
            backend=data["backend"], device_type=data["device_type"], world_size=data["world_size"],
            torch_version=data["torch_version"], nodes=tuple(data.get("nodes", ())), matrix=matrix,
            fallbacks=tuple(FallbackResult(**f) for f in data.get("fallbacks", ())),
            fallback_choices=tuple(FallbackChoice(**c) for c in data.get("fallback_choices", ())),
            bandwidth=tuple(BandwidthRow(**r) for r in data.get("bandwidth", ())),
            option_mapping=tuple(data.get("option_mapping", ())), created_at=data.get("created_at", ""),
            extra=dict(data.get("extra", {})))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{source}: not a valid comm result ({type(exc).__name__}: {exc})") from exc


def write_json(result: CommResult, path: Path) -> Path:
    """Write the result file (atomically: temporary name, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(to_json_dict(result), indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def read_json(path: Path) -> CommResult:
    """Read a result file written by :func:`write_json` (e.g. the source cluster's)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    return from_json_dict(data, str(path))


BANDWIDTH_COLUMNS = ("op", "mode", "dtype", "world_size", "size_bytes", "count", "time_us", "algbw_gbps",
                     "busbw_gbps", "min_rank_time_us", "max_rank_time_us", "error")


def bandwidth_csv(rows: Sequence[BandwidthRow]) -> str:
    """The bandwidth table as CSV (one line per op, mode and size)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=BANDWIDTH_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: getattr(row, k) for k in BANDWIDTH_COLUMNS})
    return buf.getvalue()


def matrix_csv(matrix: CommMatrix) -> str:
    """The matrix as CSV (one line per check, dtype and size)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["check", "dtype", "numel", "status", "wrong_ranks", "error_ranks", "max_abs_err", "detail"])
    for c in matrix.cells:
        writer.writerow([c.check, c.dtype, c.numel, c.status, " ".join(map(str, c.wrong_ranks)),
                         " ".join(map(str, c.error_ranks)), c.max_abs_err, c.detail])
    return buf.getvalue()


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def matrix_summary(matrix: CommMatrix) -> list[tuple[str, dict[str, str]]]:
    """Per check, per dtype: 'ok', 'n/a', or the failing status with the sizes it failed at."""
    dtypes = list(dict.fromkeys(c.dtype for c in matrix.cells))
    rows: list[tuple[str, dict[str, str]]] = []
    for check in dict.fromkeys(c.check for c in matrix.cells):
        entry: dict[str, str] = {}
        for dtype in dtypes:
            cells = [c for c in matrix.cells if c.check == check and c.dtype == dtype]
            if not cells:
                continue
            bad = [c for c in cells if c.status in ("error", "wrong")]
            if bad:
                status = "error" if any(c.status == "error" for c in bad) else "WRONG"
                entry[dtype] = f"{status} @ {','.join(str(c.numel) for c in bad)}"
            elif all(c.status == "n/a" for c in cells):
                entry[dtype] = "n/a"
            else:
                entry[dtype] = "ok"
        rows.append((check, entry))
    return rows


def markdown(result: CommResult, comparison_md: str = "") -> str:
    """Human summary: matrix by check x dtype, failures with the backend's message, fallbacks, bandwidth."""
    lines = [f"# Collectives on {result.backend} ({result.device_type}, world size {result.world_size})", "",
             f"torch {result.torch_version}; nodes: {', '.join(result.nodes) or '-'}", ""]
    if result.matrix is not None:
        summary = matrix_summary(result.matrix)
        dtypes = list(dict.fromkeys(d for _, e in summary for d in e))
        lines += ["## Capability and correctness", "", "| check | " + " | ".join(dtypes) + " |",
                  "|---" * (len(dtypes) + 1) + "|"]
        for check, entry in summary:
            lines.append(f"| {check} | " + " | ".join(entry.get(d, "") for d in dtypes) + " |")
        failing = [c for c in result.matrix.cells if c.status in ("error", "wrong")]
        seen: set[tuple[str, str]] = set()
        if failing:
            lines += ["", "Failures (first size per check and dtype):", ""]
        for c in failing:
            if (c.check, c.dtype) in seen:
                continue
            seen.add((c.check, c.dtype))
            lines.append(f"- `{c.check}` {c.dtype} n={c.numel}: {c.status}: {c.detail}")
        lines.append("")
    if result.fallback_choices:
        lines += ["## Fallbacks for what training needs", "", "| check | dtype | status | fallback | reason |",
                  "|---|---|---|---|---|"]
        lines += [f"| {c.check} | {c.dtype} | {c.status} | {c.fallback or 'NONE'} | {c.reason} |"
                  for c in result.fallback_choices]
        lines.append("")
    if result.fallbacks:
        lines += ["## Fallback correctness and cost", "",
                  "| fallback | replaces | dtype | numel | status | fallback us | native | native us | cost x |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {f.fallback} | {f.replaces} | {f.dtype} | {f.numel} | {f.status} | {_fmt(f.fallback_s * 1e6, 1)}"
                  f" | {f.native_status} | {_fmt(None if f.native_s is None else f.native_s * 1e6, 1)}"
                  f" | {_fmt(f.cost_ratio)} |" for f in result.fallbacks]
        lines.append("")
    if result.bandwidth:
        lines += ["## Bandwidth (nccl-tests definitions)", "",
                  "| op | mode | bytes | time us | algbw GB/s | busbw GB/s |", "|---|---|---|---|---|---|"]
        lines += [f"| {r.op} | {r.mode} | {r.size_bytes} | {_fmt(r.time_us, 1)} | {_fmt(r.algbw_gbps, 3)}"
                  f" | {_fmt(r.busbw_gbps, 3)}{' ' + r.error if r.error else ''} |" for r in result.bandwidth]
        lines.append("")
    unmapped = [o for o in result.option_mapping if o.get("status") == "unmapped"]
    if result.option_mapping:
        lines += ["## Communication options", "", "| option | value | status | target | note |",
                  "|---|---|---|---|---|"]
        lines += [f"| {o['key']} | {o['value']} | {o['status']} | "
                  f"{(o.get('target_key') or '-')}={o.get('target_value') or '-'} | {o['note']} |"
                  for o in result.option_mapping]
        lines.append(f"\n{len(unmapped)} option(s) have no equivalent on {result.backend}.\n")
    if comparison_md:
        lines += [comparison_md, ""]
    return "\n".join(lines)


def plot_bandwidth(rows: Sequence[BandwidthRow], path: Path, title: str = "") -> Path:
    """busbw against message size, one line per op and mode (log-log), written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict[tuple[str, str], list[BandwidthRow]] = {}
    for r in rows:
        if r.busbw_gbps is not None and r.busbw_gbps > 0:
            series.setdefault((r.op, r.mode), []).append(r)
    for (op, mode), pts in sorted(series.items()):
        pts = sorted(pts, key=lambda r: r.size_bytes)
        ax.plot([p.size_bytes for p in pts], [p.busbw_gbps or 0.0 for p in pts], marker="o",  # rows above have one
                linestyle="-" if mode == "out_of_place" else "--", label=f"{op} ({mode.replace('_', '-')})")
    ax.set_xscale("log", base=2)
    if series:
        ax.set_yscale("log")
        ax.legend(fontsize=7, loc="best")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title or "bus bandwidth")
    ax.grid(True, which="both", alpha=0.3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

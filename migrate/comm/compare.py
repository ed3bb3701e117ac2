"""Source vs target: what a move between backends loses, breaks and costs.

:func:`compare_results` is pure: given the source cluster's result file and the
target's result, it lists per (check, dtype)

* support lost (worked on the source, the target raises) and gained;
* correctness differences (correct on one side, wrong data on the other);
* checks only one side ran (not compared, so nobody reads silence as a pass);

and per (op, mode, size) the bandwidth ratio target/source of busbw (and time).
Sizes are compared only where both sides measured them.
"""

from __future__ import annotations

from dataclasses import dataclass

from migrate.comm.fallbacks import cell_status
from migrate.comm.matrix import CommMatrix
from migrate.comm.report import CommResult


@dataclass(frozen=True, kw_only=True, slots=True)
class StatusChange:
    """(check, dtype) whose status differs between source and target."""

    check: str
    dtype: str
    source: str
    target: str
    target_detail: str


@dataclass(frozen=True, kw_only=True, slots=True)
class BandwidthRatio:
    """busbw and time of one (op, mode, size) on both sides; ratio = target / source."""

    op: str
    mode: str
    size_bytes: int
    source_busbw_gbps: float
    target_busbw_gbps: float
    busbw_ratio: float
    source_time_us: float
    target_time_us: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    """Everything that differs between the source's and the target's results."""

    source: str
    target: str
    lost_support: tuple[StatusChange, ...]
    gained_support: tuple[StatusChange, ...]
    correctness: tuple[StatusChange, ...]
    only_source: tuple[tuple[str, str], ...]
    only_target: tuple[tuple[str, str], ...]
    bandwidth: tuple[BandwidthRatio, ...]

    @property
    def regressions(self) -> int:
        """Lost support plus cells that became wrong."""
        return len(self.lost_support) + sum(1 for c in self.correctness if c.target == "wrong")


def _keys(matrix: CommMatrix | None) -> list[tuple[str, str]]:
    if matrix is None:
        return []
    return list(dict.fromkeys((c.check, c.dtype) for c in matrix.cells))


def _common_status(matrix: CommMatrix, check: str, dtype: str, sizes: set[int]) -> str:
    sub = CommMatrix(backend=matrix.backend, device_type=matrix.device_type, world_size=matrix.world_size,
                     torch_version=matrix.torch_version,
                     cells=tuple(c for c in matrix.cells if c.check == check and c.dtype == dtype
                                 and (c.numel in sizes or c.check == "barrier")))
    return cell_status(sub, check, dtype)


def _detail(matrix: CommMatrix, check: str, dtype: str) -> str:
    for c in matrix.cells:
        if c.check == check and c.dtype == dtype and c.status in ("error", "wrong"):
            return f"n={c.numel}: {c.detail}"
    return ""


def compare_results(source: CommResult, target: CommResult) -> Comparison:
    """Compare a source cluster's result with the target's (see the module docstring)."""
    lost: list[StatusChange] = []
    gained: list[StatusChange] = []
    correctness: list[StatusChange] = []
    src_keys, tgt_keys = _keys(source.matrix), _keys(target.matrix)
    common = [k for k in src_keys if k in set(tgt_keys)]
    if source.matrix is not None and target.matrix is not None:
        for check, dtype in common:
            sizes = ({c.numel for c in source.matrix.cells if c.check == check and c.dtype == dtype}
                     & {c.numel for c in target.matrix.cells if c.check == check and c.dtype == dtype})
            s = _common_status(source.matrix, check, dtype, sizes)
            t = _common_status(target.matrix, check, dtype, sizes)
            if s == t:
                continue
            change = StatusChange(check=check, dtype=dtype, source=s, target=t,
                                  target_detail=_detail(target.matrix, check, dtype)
                                  or _detail(source.matrix, check, dtype))
            if s in ("ok", "wrong") and t == "error":
                lost.append(change)
            elif s == "error" and t in ("ok", "wrong"):
                gained.append(change)
            if (s == "wrong") != (t == "wrong"):
                correctness.append(change)
    src_bw = {(r.op, r.mode, r.size_bytes): r for r in source.bandwidth if r.busbw_gbps}
    ratios: list[BandwidthRatio] = []
    for r in target.bandwidth:
        src = src_bw.get((r.op, r.mode, r.size_bytes))
        if src is None or not r.busbw_gbps or src.busbw_gbps is None or src.time_us is None or r.time_us is None:
            continue
        ratios.append(BandwidthRatio(op=r.op, mode=r.mode, size_bytes=r.size_bytes,
                                     source_busbw_gbps=src.busbw_gbps, target_busbw_gbps=r.busbw_gbps,
                                     busbw_ratio=r.busbw_gbps / src.busbw_gbps, source_time_us=src.time_us,
                                     target_time_us=r.time_us))
    return Comparison(
        source=f"{source.backend}/{source.device_type} x{source.world_size}",
        target=f"{target.backend}/{target.device_type} x{target.world_size}",
        lost_support=tuple(lost), gained_support=tuple(gained), correctness=tuple(correctness),
        only_source=tuple(k for k in src_keys if k not in set(tgt_keys)),
        only_target=tuple(k for k in tgt_keys if k not in set(src_keys)),
        bandwidth=tuple(ratios))


def comparison_markdown(cmp: Comparison) -> str:
    """Markdown section for the report."""
    lines = [f"## Source ({cmp.source}) vs target ({cmp.target})", ""]
    if cmp.lost_support:
        lines += ["Support lost on the target:", ""]
        lines += [f"- `{c.check}` {c.dtype}: {c.source} -> {c.target}: {c.target_detail}" for c in cmp.lost_support]
        lines.append("")
    if cmp.correctness:
        lines += ["Correctness differences:", ""]
        lines += [f"- `{c.check}` {c.dtype}: {c.source} -> {c.target}: {c.target_detail}" for c in cmp.correctness]
        lines.append("")
    if cmp.gained_support:
        lines += ["Support gained: " + ", ".join(f"`{c.check}` {c.dtype}" for c in cmp.gained_support), ""]
    if not (cmp.lost_support or cmp.correctness or cmp.gained_support):
        lines += ["Same support and correctness on every compared (check, dtype).", ""]
    if cmp.only_source:
        lines += ["Checked on the source only (not compared): "
                  + ", ".join(f"`{c}` {d}" for c, d in cmp.only_source), ""]
    if cmp.only_target:
        lines += ["Checked on the target only: " + ", ".join(f"`{c}` {d}" for c, d in cmp.only_target), ""]
    if cmp.bandwidth:
        lines += ["| op | mode | bytes | source busbw GB/s | target busbw GB/s | target/source |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r.op} | {r.mode} | {r.size_bytes} | {r.source_busbw_gbps:.3f} | {r.target_busbw_gbps:.3f} "
                  f"| {r.busbw_ratio:.2f} |" for r in cmp.bandwidth]
    return "\n".join(lines)

"""The ranked table of a search as Markdown and JSON."""
from __future__ import annotations

from typing import Any

from parallel_search.search import Row, SearchResult


def _gb(value: float | None) -> str:
    return "" if value is None else f"{value / 1e9:.3f}"


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value * 1e3:.1f}"


def row_dict(row: Row) -> dict[str, Any]:
    return {
        "key": row.candidate.key, "label": row.candidate.label(), "candidate": row.candidate.to_dict(),
        "status": row.status, "predicted_s": row.predicted_s, "measured_s": row.measured_s,
        "measured_steps": row.measured_steps, "predicted_memory_bytes": row.memory.total,
        "memory": row.memory.to_dict(), "measured_peak_bytes": row.measured_peak_bytes,
        "predicted_mfu": row.predicted_mfu, "measured_mfu": row.measured_mfu, "tokens_per_s": row.tokens_per_s,
        "reason": row.reason,
    }


def result_dict(result: SearchResult) -> dict[str, Any]:
    return {
        "chosen": row_dict(result.chosen) if result.chosen else None,
        "target_mfu": result.target_mfu, "target_met": result.target_met,
        "space_size": result.space_size, "rejected": result.rejected, "feasible": result.feasible,
        "profiled": result.profiled, "profiled_fraction": result.profiled_fraction,
        "profile_calls": result.profile_calls, "cache_hits": result.cache_hits,
        "calibration": result.calibration.to_dict(), "reason_counts": dict(result.reason_counts),
        "events": list(result.events), "rows": [row_dict(r) for r in result.rows],
    }


def markdown_table(result: SearchResult, limit: int = 20) -> str:
    """The top ``limit`` rows: measured ones by time, then the rest by prediction."""
    lines = ["| # | candidate | status | predicted ms | measured ms | mem pred GB | mem peak GB | MFU | tokens/s | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for i, row in enumerate(result.rows[:limit], 1):
        mark = " **(chosen)**" if result.chosen is not None and row.candidate.key == result.chosen.candidate.key else ""
        mfu = row.measured_mfu if row.measured_mfu is not None else row.predicted_mfu
        mfu_text = f"{mfu:.3f}" + ("" if row.measured_mfu is not None else " (pred)")
        tps = "" if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f}"
        lines.append(f"| {i} | {row.candidate.label()}{mark} | {row.status} | {_ms(row.predicted_s)} | "
                     f"{_ms(row.measured_s)} | {_gb(row.memory.total)} | {_gb(row.measured_peak_bytes)} | {mfu_text} | "
                     f"{tps} | {(row.reason or '')[:120]} |")
    return "\n".join(lines)


def summary_markdown(result: SearchResult, limit: int = 20) -> str:
    chosen = result.chosen.candidate.label() if result.chosen else "none"
    head = [
        f"Space: {result.space_size} candidates, {result.rejected} rejected by rules, {result.feasible} fit in memory; "
        f"{result.profiled} profiled ({result.profiled_fraction:.0%}), {result.profile_calls} profile run(s), "
        f"{result.cache_hits} from the cache.",
        f"Chosen: **{chosen}**" + (f", measured MFU {result.chosen.measured_mfu:.3f}" if result.chosen and
                                   result.chosen.measured_mfu is not None else "")
        + (f" (target {result.target_mfu:.3f}: {'met' if result.target_met else 'NOT met'})" if result.target_mfu else ""),
        "Calibration factors: " + ", ".join(f"{k} {v:.3g}" for k, v in result.calibration.factors.items())
        + (f" (fit error {result.calibration.fit_error:.1%} over {result.calibration.samples})"
           if result.calibration.fit_error is not None else ""),
        "", markdown_table(result, limit), "",
    ]
    if result.reason_counts:
        head += ["Rejected by rule:", *[f"- {k}: {v}" for k, v in result.reason_counts.items()], ""]
    if result.events:
        head += ["Search trail:", *[f"- {e}" for e in result.events], ""]
    return "\n".join(head)

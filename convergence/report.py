"""Report of a verdict: PNG plots (matplotlib Agg), Markdown and a self-contained HTML.

``write_report(verdict, directory)`` writes ``verdict.json``, ``report.md``,
``report.html``, ``loss.png``, ``grad_norm.png`` (when grad norms exist) and
``deviation.png``; returns the paths by name.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from convergence.calibration import Bands
from convergence.verdict import Verdict


def _plot_metric(bands: Bands, baselines: np.ndarray, candidate: np.ndarray, title: str, path: Path,
                 log: bool = False, xlabel: str = "step", ylabel: str = "") -> None:
    """The band, each baseline (wide, light, beneath) and the candidate (thin, dark, on top), so that a
    candidate equal to its baseline still shows both."""
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    ax.fill_between(bands.steps, bands.lower, bands.upper, color="tab:blue", alpha=0.15, lw=0,
                    label="band: where one step of a good run may lie")
    colors = ["tab:gray", "tab:olive", "tab:cyan", "tab:brown", "tab:pink"]
    for i, row in enumerate(baselines):
        ax.plot(bands.steps, row, color=colors[i % len(colors)], lw=3.0, alpha=0.55, label=f"baseline {i + 1}")
    ax.plot(bands.steps, candidate, color="tab:red", lw=1.0, label="candidate")
    bad = np.isfinite(candidate) & ~bands.contains(candidate)
    if bad.any():
        ax.scatter(bands.steps[bad], candidate[bad], color="black", s=14, zorder=3, label="outside the band")
    nonfinite = ~np.isfinite(candidate)
    if nonfinite.any():
        for j, s in enumerate(bands.steps[nonfinite]):
            ax.axvline(s, color="tab:purple", lw=0.8, alpha=0.6, label="NaN/Inf" if j == 0 else None)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel or title)
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_deviation(verdict: Verdict, path: Path) -> None:
    """|candidate - baseline centre| and the band's half-width on a log scale, so agreement at 1e-7 shows as
    well as a drift at 1e-2; the baselines' own deviations from their centre for comparison."""
    b = verdict.loss_bands
    assert b is not None and verdict.candidate_loss is not None
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=100)
    tiny = 1e-12
    with np.errstate(all="ignore"):
        dev = np.abs(verdict.candidate_loss - b.center)
        half = b.upper - b.center
        ax.plot(b.steps, np.maximum(half, tiny), color="tab:blue", lw=1.0, label="band half-width")
        if verdict.baseline_loss is not None and verdict.baseline_loss.shape[0] >= 2:
            for i, row in enumerate(verdict.baseline_loss):
                ax.plot(b.steps, np.maximum(np.abs(row - b.center), tiny), color="0.6", lw=0.7, alpha=0.7,
                        label="baselines - centre" if i == 0 else None)
        ax.plot(b.steps, np.maximum(dev, tiny), color="tab:red", lw=1.2, label="|candidate - centre|")
    ax.set_yscale("log")
    ax.set_xlabel("consumed tokens" if verdict.align_by == "tokens" else "step")
    ax.set_ylabel("|loss deviation| (log scale)")
    ax.set_title("loss deviation from the baselines' centre")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _sources(info: dict) -> str:
    return ", ".join(f"{k}: {v} steps" for k, v in info["sources"].items())


def _markdown(verdict: Verdict, images: dict[str, str]) -> str:
    d = verdict.to_dict()
    lines = [f"# Convergence gate: **{d['verdict'].upper()}**", "",
             f"* candidate: `{verdict.candidate}`",
             *[f"* baseline: `{b}`" for b in verdict.baselines],
             f"* aligned by: {verdict.align_by}", ""]
    if verdict.reasons:
        lines += ["## Why it failed", "", *[f"* {r}" for r in verdict.reasons], ""]
    lines += ["## Decision rule", "", *[f"* {r}" for r in verdict.rule], "",
              "## Alignment", "", *[f"* {a}" for a in verdict.alignment], "", "## Bands", ""]
    for metric, info in d["bands"].items():
        lines.append(f"* {metric}: {_sources(info)}")
    lines += ["", "## Checks", "", "| check | result | reason |", "|---|---|---|"]
    for c in verdict.checks:
        state = "skipped" if c.skipped else ("pass" if c.passed else "**FAIL**")
        lines.append(f"| {c.code} | {state} | {c.reason.replace('|', '/')} |")
    lines += ["", "## Plots", ""]
    lines += [f"![{name}]({file})" for name, file in images.items()]
    return "\n".join(lines) + "\n"


def _html(verdict: Verdict, directory: Path, images: dict[str, str]) -> str:
    d = verdict.to_dict()
    color = "#1a7f37" if verdict.passed else "#cf222e"
    rows = "".join(
        f"<tr><td>{html.escape(c.code)}</td><td>{'skipped' if c.skipped else ('pass' if c.passed else '<b>FAIL</b>')}"
        f"</td><td>{html.escape(c.reason)}</td></tr>" for c in verdict.checks)
    reasons = "".join(f"<li>{html.escape(r)}</li>" for r in verdict.reasons)
    bands = "".join(f"<li>{html.escape(m)}: {html.escape(_sources(i))}</li>" for m, i in d["bands"].items())
    rule = "".join(f"<li>{html.escape(r)}</li>" for r in verdict.rule)
    alignment = "".join(f"<li>{html.escape(a)}</li>" for a in verdict.alignment)
    pictures = "".join(
        f'<figure><img alt="{html.escape(n)}" src="data:image/png;base64,'
        f'{base64.b64encode((directory / f).read_bytes()).decode()}"/><figcaption>{html.escape(n)}</figcaption></figure>'
        for n, f in images.items())
    runs = "".join(f"<li>baseline: <code>{html.escape(b)}</code></li>" for b in verdict.baselines)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Convergence gate: {d['verdict']}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}
td{{border-top:1px solid #ddd;padding:.3em;vertical-align:top}}
h1 span{{color:{color}}}img{{max-width:100%}}</style></head><body>
<h1>Convergence gate: <span>{d['verdict'].upper()}</span></h1>
<ul><li>candidate: <code>{html.escape(verdict.candidate)}</code></li>{runs}
<li>aligned by {html.escape(verdict.align_by)}</li></ul>
{'<h2>Why it failed</h2><ul>' + reasons + '</ul>' if reasons else ''}
<h2>Decision rule</h2><ul>{rule}</ul>
<h2>Alignment</h2><ul>{alignment}</ul>
<h2>Bands</h2><ul>{bands}</ul>
<h2>Checks</h2><table><tr><th>check</th><th>result</th><th>reason</th></tr>{rows}</table>
<h2>Plots</h2>{pictures}
</body></html>
"""


def write_report(verdict: Verdict, directory: str | Path) -> dict[str, Path]:
    """Write the verdict JSON, the plots, the Markdown and the HTML report into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = {"verdict": directory / "verdict.json"}
    out["verdict"].write_text(verdict.to_json() + "\n", encoding="utf-8")
    images: dict[str, str] = {}
    lb = verdict.loss_bands
    if lb is not None and len(lb.steps) and verdict.candidate_loss is not None and verdict.baseline_loss is not None:
        _plot_metric(lb, verdict.baseline_loss, verdict.candidate_loss, "loss", directory / "loss.png",
                     xlabel="consumed tokens" if verdict.align_by == "tokens" else "step", ylabel="loss")
        images["loss"] = "loss.png"
        gb = verdict.grad_norm_bands
        if gb is not None and verdict.candidate_grad_norm is not None and verdict.baseline_grad_norm is not None:
            _plot_metric(gb, verdict.baseline_grad_norm, verdict.candidate_grad_norm, "gradient norm",
                         directory / "grad_norm.png", log=True, ylabel="gradient norm (log scale)",
                         xlabel="consumed tokens" if verdict.align_by == "tokens" else "step")
            images["grad_norm"] = "grad_norm.png"
        _plot_deviation(verdict, directory / "deviation.png")
        images["deviation"] = "deviation.png"
    for name, file in images.items():
        out[name] = directory / file
    out["markdown"] = directory / "report.md"
    out["markdown"].write_text(_markdown(verdict, images), encoding="utf-8")
    out["html"] = directory / "report.html"
    out["html"].write_text(_html(verdict, directory, images), encoding="utf-8")
    return out

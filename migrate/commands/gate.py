"""``migrate gate``: judge a candidate run's loss and grad norm against baseline runs.

Exit codes: 0 pass, 1 fail, 2 bad input (a source or tolerance file that cannot be
used; the message names the file and what was expected).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from convergence.gate import MetricKeys, evaluate
from convergence.report import write_report
from convergence.series import SeriesError
from convergence.tolerances import ToleranceError, Tolerances, load_tolerances, tolerances_from_mapping, tolerances_to_mapping

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _tolerances(path: Path | None, align_by: str | None, restart_policy: str | None) -> Tolerances:
    tol = load_tolerances(path) if path else Tolerances()
    if align_by or restart_policy:
        data = tolerances_to_mapping(tol)
        data["coverage"]["key_steps"] = list(data["coverage"]["key_steps"])
        if align_by:
            data["align"]["by"] = align_by
        if restart_policy:
            data["align"]["restart_policy"] = restart_policy
        tol = tolerances_from_mapping(data)
    return tol


@click.command(name="gate")
@click.option("--baseline", "baselines", multiple=True, required=True, metavar="SRC",
              help="baseline run (repeat for calibration): PATH, FORMAT:PATH or wandb:ENTITY/PROJECT/RUN")
@click.option("--candidate", required=True, metavar="SRC", help="the run to judge (same spec forms)")
@click.option("--tolerances", "tolerances_file", type=click.Path(path_type=Path, dir_okay=False),
              help="tolerances YAML (unknown keys are errors)")
@click.option("--report", "report_dir", type=click.Path(path_type=Path, file_okay=False),
              help="write verdict.json, report.md, report.html and plots here")
@click.option("--align-by", type=click.Choice(["step", "tokens"]), help="override align.by")
@click.option("--restart-policy", type=click.Choice(["last", "first", "error"]), help="override align.restart_policy")
@click.option("--loss-key", help="series name of the loss (default: common names such as 'lm loss', 'loss')")
@click.option("--grad-norm-key", help="series name of the gradient norm")
@click.option("--lr-key", help="series name of the learning rate")
@click.option("--json", "as_json", is_flag=True, help="print the verdict JSON on stdout")
def command(baselines: tuple[str, ...], candidate: str, tolerances_file: Path | None, report_dir: Path | None,
            align_by: str | None, restart_policy: str | None, loss_key: str | None, grad_norm_key: str | None,
            lr_key: str | None, as_json: bool) -> None:
    """Pass (exit 0) only when the candidate's loss, grad norm and lr stay within tolerance of the baselines."""
    from migrate.gate.sources import load_run

    try:
        tol = _tolerances(tolerances_file, align_by, restart_policy)
        policy = tol.align.restart_policy
        base_runs = [load_run(spec, policy=policy) for spec in baselines]
        cand_run = load_run(candidate, policy=policy)
        verdict = evaluate(base_runs, cand_run, tol, MetricKeys(loss=loss_key, grad_norm=grad_norm_key, lr=lr_key))
    except (SeriesError, ToleranceError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    if report_dir is not None:
        paths = write_report(verdict, report_dir)
        click.echo(f"report: {paths['html']}", err=True)
    if as_json:
        click.echo(verdict.to_json())
    else:
        click.echo(f"gate: {'PASS' if verdict.passed else 'FAIL'}")
        for reason in verdict.reasons:
            click.echo(f"  - {reason}")
    sys.exit(EXIT_OK if verdict.passed else EXIT_FAILED)

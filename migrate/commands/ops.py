"""``migrate ops``: operator numerics on a device against float64 on the CPU.

Runs in this process on ``--device`` (use the ``ops`` stage of a job to run it on the
target cluster's workers). With ``--job`` the job's model is also scanned for operator
coverage and compared layer by layer (device in ``--drift-dtype`` vs CPU fp32).
Exit codes: 0 pass, 1 a check failed, 2 bad input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from convergence.ops.numerics import DTYPES, OPERATORS

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


@click.command(name="ops")
@click.argument("job_argument", required=False, metavar="[JOB.yaml]", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--device", default="cpu", show_default=True, help="torch device to test (cpu, cuda:0, npu:0, ...)")
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(list(DTYPES)), help="dtypes (default: all)")
@click.option("--op", "ops", multiple=True, type=click.Choice(list(OPERATORS)), help="operators (default: all)")
@click.option("--job", "job_file", type=click.Path(path_type=Path, dir_okay=False),
              help="also scan this job's model for coverage and layer drift")
@click.option("--drift-dtype", type=click.Choice(list(DTYPES)), help="dtype of the drift run (default: the job's precision)")
@click.option("--report", "report_dir", type=click.Path(path_type=Path, file_okay=False),
              help="write ops.json and ops.md here")
def command(job_argument: Path | None, device: str, dtypes: tuple[str, ...], ops: tuple[str, ...], job_file: Path | None,
            drift_dtype: str | None, report_dir: Path | None) -> None:
    """Forward/backward numerics of transformer operators, coverage and layer drift (of JOB.yaml's model, given
    as the argument or with --job)."""
    import torch

    from convergence.ops.suite import run_suite, summary_markdown

    try:
        torch.device(device)
    except RuntimeError as exc:
        click.echo(f"error: --device {device!r}: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    if job_argument is not None and job_file is not None and job_argument != job_file:
        click.echo(f"error: two jobs given: {job_argument} and --job {job_file}; give one", err=True)
        sys.exit(EXIT_BAD_INPUT)
    job_file = job_file or job_argument
    kwargs = {}
    if job_file is not None:
        from migrate.commands._common import load_or_exit
        from migrate.stages.ops import model_inputs

        job = load_or_exit(job_file)
        kwargs = model_inputs(job.spec.model.model_dump(), job.spec.training.seed)
        drift_dtype = drift_dtype or job.spec.training.precision
    result = run_suite(device, dtypes or tuple(DTYPES), ops=ops or None, drift_dtype=drift_dtype or "fp32", **kwargs)
    text = summary_markdown(result)
    if report_dir is not None:
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / "ops.json").write_text(json.dumps(result, indent=2, default=str))
        (report_dir / "ops.md").write_text(text)
    click.echo(text)
    sys.exit(EXIT_OK if result["passed"] else EXIT_FAILED)

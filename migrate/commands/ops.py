"""``migrate ops``: operator numerics on a device against float64 on the CPU, the user's registered
operators, and dump/compare across clusters.

Runs in this process on ``--device`` (use the ``ops`` stage of a job to run it on the target cluster's
workers). With a job, its model is scanned for coverage and compared layer by layer (device in
``--drift-dtype`` vs CPU fp32), and the operators its ``stages.ops`` registers are checked; ``--registry``
adds a module or ``.py`` file defining ``OPERATORS``. ``--dump DIR`` records every operator and the model
step; ``--compare DIR`` replays a dump made elsewhere (``--world-size N``: the model step on N local
data-parallel ranks). Exit codes: 0 pass, 1 a check failed, 2 bad input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import click

from convergence.ops.numerics import DTYPES, OPERATORS

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def _run(request: Any, device: str, world_size: int) -> dict[str, Any]:
    """The suite in this process, or rank 0's result of `world_size` local ranks (a compare's model step)."""
    from migrate.stages.ops import probe

    if world_size == 1:
        result = probe(SimpleNamespace(device=device, rank=0, world_size=1), request)
        assert result is not None  # rank 0 returns the suite's result
        return result
    from migrate.runtime.worker_group import WorkerGroupSpec, start_worker_group

    kind = device.split(":")[0]
    spec = WorkerGroupSpec(world_size=world_size, mode="local", device_type=kind, timeout_s=600)
    with start_worker_group(spec) as group:
        first = group.run(probe, request)[0]
    assert first is not None  # rank 0 returns the suite's result
    return first


@click.command(name="ops")
@click.argument("job_argument", required=False, metavar="[JOB.yaml]", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--device", default="cpu", show_default=True, help="torch device to test (cpu, cuda:0, npu:0, ...)")
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(list(DTYPES)), help="dtypes (default: the job's, else all)")
@click.option("--op", "ops", multiple=True, type=click.Choice(list(OPERATORS)), help="built-in operators (default: all)")
@click.option("--job", "job_file", type=click.Path(path_type=Path, dir_okay=False),
              help="also scan this job's model for coverage and layer drift, and check its registered operators")
@click.option("--drift-dtype", type=click.Choice(list(DTYPES)), help="dtype of the drift run (default: the job's precision)")
@click.option("--registry", "registries", multiple=True, metavar="MODULE|FILE.py",
              help="a module or .py file defining OPERATORS (repeatable)")
@click.option("--dump", "dump_dir", type=click.Path(path_type=Path, file_okay=False),
              help="record every operator and the model step here (safetensors)")
@click.option("--compare", "compare_dir", type=click.Path(path_type=Path, file_okay=False),
              help="replay a dump made on another cluster and name what drifts")
@click.option("--compare-dtype", type=click.Choice(list(DTYPES)), help="replay the dump in this dtype")
@click.option("--world-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="data-parallel ranks that run the compared model step (local processes)")
@click.option("--report", "report_dir", type=click.Path(path_type=Path, file_okay=False),
              help="write ops.json and ops.md here")
def command(job_argument: Path | None, device: str, dtypes: tuple[str, ...], ops: tuple[str, ...], job_file: Path | None,
            drift_dtype: str | None, registries: tuple[str, ...], dump_dir: Path | None, compare_dir: Path | None,
            compare_dtype: str | None, world_size: int, report_dir: Path | None) -> None:
    """Forward/backward numerics of transformer operators and of the operators a job registers, coverage and
    layer drift (of JOB.yaml's model, given as the argument or with --job), dump and compare across clusters."""
    import torch

    from convergence.ops.dump import DumpError
    from convergence.ops.registry import RegistryError
    from convergence.ops.suite import summary_markdown
    from migrate.stages.ops import OpsOptions, OpsRequest, ops_request

    from migrate.runtime.resources import device_unusable

    if device.split(":")[0] == "npu" and (why := device_unusable("npu")):  # npu is a device type once torch_npu is in
        _fail(f"--device {device}: {why}")
    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        _fail(f"--device {device!r}: {exc}")
    why = device_unusable(kind) if kind in ("cpu", "cuda", "npu") else None
    if why:
        _fail(f"--device {device}: {why}")
    if job_argument is not None and job_file is not None and job_argument != job_file:
        _fail(f"two jobs given: {job_argument} and --job {job_file}; give one")
    if dump_dir is not None and compare_dir is not None:
        _fail("--dump and --compare: one run either records or compares")
    if world_size > 1 and compare_dir is None:
        _fail(f"--world-size {world_size}: only a --compare runs the model step on several ranks")
    job_file = job_file or job_argument
    flags = {"dtypes": list(dtypes) or None, "operators": list(ops) or None, "drift_dtype": drift_dtype,
             "dump": str(dump_dir.resolve()) if dump_dir else None,
             "compare": str(compare_dir.resolve()) if compare_dir else None, "compare_dtype": compare_dtype,
             "world_size": world_size}
    if job_file is not None:
        from migrate.commands._common import load_or_exit

        job = load_or_exit(job_file)
        base = job.path.parent
        current = cast(OpsOptions, job.stage_options.get("ops") or OpsOptions())
        options = OpsOptions.model_validate({**current.model_dump(), **{k: v for k, v in flags.items() if v is not None},
                                             "registry": [*current.registry, *registries]})
        request = ops_request(job.spec, options, base)
    else:
        options = OpsOptions.model_validate({**{k: v for k, v in flags.items() if v is not None},
                                             "registry": list(registries), "model": False})
        request = OpsRequest(options=options.model_dump(mode="json"), model_section=None, seed=0,
                             drift_dtype=drift_dtype or "fp32", base=str(Path.cwd()))
    from migrate.runtime.worker_group import WorkerGroupError

    try:
        result = _run(request, device, world_size)
    except (RegistryError, DumpError) as exc:
        _fail(str(exc))
    except WorkerGroupError as exc:
        _fail(f"the {world_size} local rank(s) failed: " + "; ".join(f.describe() for f in exc.failures[:2]))
    text = summary_markdown(result)
    if report_dir is not None:
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / "ops.json").write_text(json.dumps(result, indent=2, default=str))
        (report_dir / "ops.md").write_text(text)
    click.echo(text)
    sys.exit(EXIT_OK if result["passed"] else EXIT_FAILED)

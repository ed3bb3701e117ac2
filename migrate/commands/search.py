"""``migrate search JOB.yaml``: the search stage of a job; ``--measure PROFILE.yaml`` measures the
target's devices into a device profile instead. Exit codes: 0 pass, 1 failed, 2 bad input."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from migrate.commands._common import EXIT_BAD_INPUT, EXIT_OK, job_argument, load_or_exit, run_stages


@click.command(name="search")
@job_argument
@click.option("--force", is_flag=True, help="run even if its inputs are unchanged (measurements stay cached)")
@click.option("--measure", "measure_to", type=click.Path(path_type=Path, dir_okay=False),
              help="measure the target devices (matmul, copy, all_reduce) and write a device profile here")
@click.option("--matmul-size", default=1024, show_default=True, help="matrix size for --measure")
@click.option("--no-profile", "no_profile", is_flag=True,
              help="rank the candidates with the memory and cost models alone: no cluster, no preflight, no run")
def command(job_file: Path, force: bool, measure_to: Path | None, matmul_size: int, no_profile: bool) -> None:
    """Choose the target's parallel plan from measured steps (the job's 'search' stage), or from the models
    alone with --no-profile."""
    job = load_or_exit(job_file)
    if measure_to is not None:
        sys.exit(_measure(job, measure_to, matmul_size))
    if "search" not in job.stage_options and not no_profile:
        click.echo(f"{job.path}: the job does not list stage 'search' under 'stages:' (--no-profile ranks "
                   f"analytically without it)", err=True)
        sys.exit(EXIT_BAD_INPUT)
    if no_profile:
        job = _with_search(job, {"profile": False})
    sys.exit(run_stages(job, ["search"], force))


def _with_search(job: Any, changes: dict[str, Any]) -> Any:
    """The job with its search options changed (the job's own, else the defaults)."""
    import dataclasses

    from migrate.stages.search import SearchOptions

    current = job.stage_options.get("search") or SearchOptions()
    options = SearchOptions.model_validate({**current.model_dump(), **changes})
    return dataclasses.replace(job, stage_options={**job.stage_options, "search": options})


def _measure(job, path: Path, matmul_size: int) -> int:
    from migrate.runtime.session import TargetRuntime
    from migrate.search.measure import measure_rank, measured_profile
    from migrate.search.problem import device_profile
    from parallel_search.profiles import dump_profile

    base = device_profile(job)
    dtypes = tuple(d for d in ("fp32", "bf16", "fp16") if d in base.supported_dtypes)
    with TargetRuntime(job.spec.target) as runtime, runtime.start_group() as group:
        results = group.run(measure_rank, matmul_size, 64, 16, 5, dtypes)
    profile = measured_profile(base, results)
    dump_profile(profile, path)
    click.echo(f"wrote {path}: " + ", ".join(f"{k} {v:.3g} TFLOP/s" for k, v in profile.peak_tflops.items())
               + f"; copy {profile.memory_bandwidth_gbps:.3g} GB/s; intra-node {profile.intra_node_bandwidth_gbps:.3g} GB/s;"
               f" latency {profile.collective_latency_us:.3g} us")
    return EXIT_OK

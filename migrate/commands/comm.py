"""``migrate comm``: collective checks, from a job or on a backend named on the command line.

* ``migrate comm JOB.yaml [--force]`` runs the job's ``comm`` stage (artifact, skip rule, tracking).
* ``migrate comm --backend gloo --world-size 4 [--ops all_reduce,broadcast] [--sizes 1,7,1024]
  [--json OUT] [--compare SOURCE.json]`` runs the checks on a fresh worker group (local
  processes by default, ``--ray-address`` for a Ray cluster across nodes) and writes the
  result file, CSVs, the plot and a Markdown summary.

Exit codes: 0 pass, 1 wrong data or a needed collective without fallback, 2 bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from migrate.commands._common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, load_or_exit, run_stages


def _ints(text: str | None, what: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(_size(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{what}: {text!r} is not a comma-separated list of sizes") from None
    if not values or any(v < 1 for v in values):
        raise click.BadParameter(f"{what}: every size must be >= 1, got {text!r}")
    return values


def _size(text: str) -> int:
    text = text.strip().upper()
    for suffix, factor in (("K", 2**10), ("M", 2**20), ("G", 2**30)):
        if text.endswith(suffix):
            return int(text[:-1]) * factor
    return int(text)


def _names(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(v.strip() for v in text.split(",") if v.strip())


@click.command(help="Collective checks: the comm stage of JOB_FILE, or (without JOB_FILE) --backend and "
                    "--world-size on a fresh worker group. Exit 0 pass, 1 wrong data or an unmet need, 2 bad input.")
@click.argument("job_file", required=False, type=click.Path(path_type=Path, dir_okay=False))
@click.option("--force", is_flag=True, help="(job form) run even if its inputs are unchanged")
@click.option("--backend", default=None, help="gloo, nccl, hccl, xccl, mpi, or cpu:gloo,cuda:nccl")
@click.option("--device", "device", default=None, help="cpu, cuda, npu or xpu (or a device, cuda:0) [default: cpu]")
@click.option("--device-type", "device_type", default=None, hidden=True, help="deprecated: --device")
@click.option("--world-size", type=int, default=None, help="ranks to start")
@click.option("--devices-per-node", type=int, default=None, help="ranks per node (multi-node Ray runs)")
@click.option("--ops", default=None, help="collective families or checks, comma-separated (default: all)")
@click.option("--dtypes", default=None, help="e.g. fp32,bf16,fp16,int32,int64 (default: all five)")
@click.option("--sizes", default=None, help="matrix sizes in elements per rank chunk, e.g. 1,7,1K,1M")
@click.option("--bw-ops", default=None, help="bandwidth ops (default: all)")
@click.option("--bw-sizes", default=None, help="bandwidth sizes S in bytes, e.g. 8K,1M,32M")
@click.option("--bw-dtype", default="fp32", show_default=True, help="fp32, bf16 or fp16")
@click.option("--warmup", type=int, default=5, show_default=True)
@click.option("--iters", type=int, default=20, show_default=True)
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]), default="bf16", show_default=True,
              help="training precision whose needs the fallbacks cover")
@click.option("--no-matrix", is_flag=True)
@click.option("--no-fallbacks", is_flag=True)
@click.option("--no-bandwidth", is_flag=True)
@click.option("--json", "json_out", is_flag=False, flag_value="-", default=None, metavar="",
              help="print the result JSON on stdout")
@click.option("--report", "report_dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="write comm_result.json, the CSVs, bandwidth.png and comm.md here [default: comm_out]")
@click.option("--out-dir", "out_dir", type=click.Path(path_type=Path, file_okay=False), default=None, hidden=True,
              help="deprecated: --report")
@click.option("--compare", "compare_with", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="the source cluster's result file")
@click.option("--ray-address", default=None, help="run on Ray (embedded, auto, ray://...); default local processes")
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True)
def command(job_file: Path | None, force: bool, backend: str | None, device: str | None, device_type: str | None,
            world_size: int | None, devices_per_node: int | None, ops: str | None, dtypes: str | None,
            sizes: str | None, bw_ops: str | None, bw_sizes: str | None, bw_dtype: str, warmup: int, iters: int,
            precision: str, no_matrix: bool, no_fallbacks: bool, no_bandwidth: bool, json_out: str | None,
            report_dir: Path | None, out_dir: Path | None, compare_with: Path | None, ray_address: str | None,
            timeout_s: float) -> None:
    device, report_dir, json_path = _current_spelling(device, device_type, report_dir, out_dir, json_out)
    if job_file is not None:
        if backend or world_size:
            click.echo("give either JOB_FILE or --backend/--world-size, not both", err=True)
            sys.exit(EXIT_BAD_INPUT)
        job = load_or_exit(job_file)
        if "comm" not in job.stage_options:
            click.echo(f"{job.path}: the job does not list stage 'comm' under 'stages:'", err=True)
            sys.exit(EXIT_BAD_INPUT)
        sys.exit(run_stages(job, ["comm"], force))
    if not backend or not world_size:
        click.echo("without JOB_FILE, --backend and --world-size are required", err=True)
        sys.exit(EXIT_BAD_INPUT)
    sys.exit(_standalone(
        backend=backend, device_type=device.split(":")[0], world_size=world_size, devices_per_node=devices_per_node,
        ops=_names(ops), dtypes=_dtypes(_names(dtypes)), sizes=_ints(sizes, "--sizes"), bw_ops=_names(bw_ops),
        bw_sizes=_ints(bw_sizes, "--bw-sizes"), bw_dtype=(_dtypes((bw_dtype,)) or (bw_dtype,))[0], warmup=warmup, iters=iters,
        precision=precision, no_matrix=no_matrix, no_fallbacks=no_fallbacks, no_bandwidth=no_bandwidth,
        json_out=json_path, print_json=json_out == "-", out_dir=report_dir, compare_with=compare_with,
        ray_address=ray_address, timeout_s=timeout_s))


def _note(text: str) -> None:
    click.echo(f"note: {text} (accepted until migrate 0.3)", err=True)


def _dtypes(names: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """fp32/bf16/fp16/fp64 (and integer dtypes) as torch names; torch's own float names with a note."""
    from migrate.comm.matrix import SHORT_NAMES

    if names is None:
        return None
    out = []
    for name in names:
        if name in SHORT_NAMES.values():
            short = next(k for k, v in SHORT_NAMES.items() if v == name)
            _note(f"dtype {name!r} is deprecated, use {short!r}")
        out.append(SHORT_NAMES.get(name, name))
    return tuple(out)


def _current_spelling(device: str | None, device_type: str | None, report_dir: Path | None, out_dir: Path | None,
                      json_out: str | None) -> tuple[str, Path, Path | None]:
    """(device, report folder, result file) from the options, earlier spellings noted."""
    if device_type is not None:
        _note("--device-type is deprecated, use --device")
    if out_dir is not None:
        _note("--out-dir is deprecated, use --report")
    json_path = None
    if json_out not in (None, "-"):
        _note("--json FILE is deprecated: --json prints the result on stdout, --report DIR writes it to DIR")
        json_path = Path(json_out)
    return device or device_type or "cpu", report_dir or out_dir or Path("comm_out"), json_path


def _standalone(*, backend: str, device_type: str, world_size: int, devices_per_node: int | None,
                ops: tuple[str, ...] | None, dtypes: tuple[str, ...] | None, sizes: tuple[int, ...] | None,
                bw_ops: tuple[str, ...] | None, bw_sizes: tuple[int, ...] | None, bw_dtype: str, warmup: int,
                iters: int, precision: str, no_matrix: bool, no_fallbacks: bool, no_bandwidth: bool,
                json_out: Path | None, out_dir: Path, compare_with: Path | None, ray_address: str | None,
                timeout_s: float, print_json: bool = False) -> int:
    from migrate.comm import bandwidth as bw
    from migrate.comm import fallbacks as fb
    from migrate.comm import matrix as mx
    from migrate.comm.backends import BackendUnavailable, select_backend
    from migrate.comm.report import read_json
    from migrate.comm.suite import CommSuite, run_suite, write_outputs
    from migrate.runtime.worker_group import WorkerGroupError, WorkerGroupSpec, start_worker_group
    from migrate.stages.comm import judge

    try:
        choice = select_backend(device_type, backend)
        train_dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]
        suite = CommSuite(
            matrix=None if no_matrix else mx.MatrixPlan(
                checks=mx.expand_checks(ops or mx.ALL_CHECKS), dtypes=dtypes or mx.DEFAULT_DTYPES,
                sizes=sizes or mx.DEFAULT_SIZES),
            fallbacks=None if no_fallbacks else fb.FallbackPlan(dtypes=tuple(dict.fromkeys((train_dtype, "float32")))),
            bandwidth=None if no_bandwidth else bw.BandwidthPlan(
                ops=bw_ops or bw.BW_OPS, sizes_bytes=bw_sizes or bw.DEFAULT_SIZES_BYTES, dtype=bw_dtype,
                warmup=warmup, iters=iters),
            precision=precision)
        spec = WorkerGroupSpec(world_size=world_size, backend=choice.process_group_backend
                               if choice.device_type != "cpu" else choice.backend,
                               device_type=choice.device_type, devices_per_node=devices_per_node,
                               timeout_s=timeout_s, mode="ray" if ray_address else "local")
        source = read_json(compare_with) if compare_with else None
    except (ValueError, BackendUnavailable) as exc:
        click.echo(f"error: {exc}", err=True)
        return EXIT_BAD_INPUT
    connection = None
    if ray_address:
        from migrate.runtime.ray_cluster import connect

        connection = connect(ray_address)
    try:
        with start_worker_group(spec) as group:
            result = run_suite(group, suite, timeout_s=timeout_s)
    except WorkerGroupError as exc:
        click.echo(f"error: {exc}", err=True)
        return EXIT_FAILED
    finally:
        if connection is not None:
            connection.close()
    paths, _comparison, text = write_outputs(result, out_dir, json_path=json_out, source=source)
    click.echo(Path(paths["result"]).read_text() if print_json else text)
    for name, path in paths.items():
        click.echo(f"{name}: {path}", err=True)
    reasons = judge(result, fail_on_missing=True)
    for reason in reasons:
        click.echo(f"problem: {reason}", err=True)
    return EXIT_FAILED if reasons else EXIT_OK

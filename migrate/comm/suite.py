"""One comm run on a started worker group: matrix, fallbacks, bandwidth, option mapping.

Shared by the ``comm`` stage and the ``migrate comm`` command.  The driver
calls :func:`run_suite` with a started group; every measurement runs on the
ranks through ``group.run`` and is merged by the pure functions of the other
modules.  :func:`write_outputs` writes the result file and its renderings.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from collections.abc import Mapping

from migrate.comm import bandwidth as bw
from migrate.comm import fallbacks as fb
from migrate.comm import matrix as mx
from migrate.comm.backends import map_comm_options
from migrate.comm.compare import Comparison, compare_results, comparison_markdown
from migrate.comm.report import CommResult, bandwidth_csv, markdown, matrix_csv, plot_bandwidth, write_json

if TYPE_CHECKING:
    from migrate.runtime.worker_group import WorkerGroup


@dataclass(frozen=True, kw_only=True, slots=True)
class CommSuite:
    """What one comm run measures (each part can be switched off with an empty tuple)."""

    matrix: mx.MatrixPlan | None
    fallbacks: fb.FallbackPlan | None
    bandwidth: bw.BandwidthPlan | None
    precision: str = "bf16"


@dataclass(frozen=True, kw_only=True, slots=True)
class OptionInputs:
    """The source job's communication settings, for the option mapping."""

    source_backend: str
    env: Mapping[str, str]
    framework: Mapping[str, object]


def run_suite(group: WorkerGroup, suite: CommSuite, *, options: OptionInputs | None = None,
              timeout_s: float | None = None) -> CommResult:
    """Run the suite's parts on every rank of ``group`` and merge them into a :class:`CommResult`."""
    contexts = group.contexts()
    ctx0 = contexts[0]
    matrix = None
    choices: tuple[fb.FallbackChoice, ...] = ()
    if suite.matrix is not None:
        per_rank = group.run(mx.run_matrix_on_rank, suite.matrix, timeout_s=timeout_s)
        matrix = mx.merge_observations(suite.matrix, per_rank, backend=ctx0.backend, device_type=ctx0.device_type)
        choices = fb.select_fallbacks(matrix, fb.training_needs(suite.precision))
    fallback_results: tuple[fb.FallbackResult, ...] = ()
    if suite.fallbacks is not None:
        per_rank_fb = group.run(fb.run_fallbacks_on_rank, suite.fallbacks, timeout_s=timeout_s)
        fallback_results = fb.merge_fallback_observations(suite.fallbacks, per_rank_fb)
    rows: tuple[bw.BandwidthRow, ...] = ()
    if suite.bandwidth is not None:
        per_rank_bw = group.run(bw.run_bandwidth_on_rank, suite.bandwidth, timeout_s=timeout_s)
        rows = bw.merge_bandwidth(suite.bandwidth, per_rank_bw)
    mapping: tuple[dict[str, object], ...] = ()
    if options is not None:
        mapped = map_comm_options(options.source_backend, ctx0.backend.split(",")[-1].split(":")[-1],
                                  options.env, options.framework)
        mapping = tuple({k: v for k, v in asdict(o).items()} for o in mapped.options)
    import torch

    return CommResult(
        backend=ctx0.backend, device_type=ctx0.device_type, world_size=ctx0.world_size,
        torch_version=torch.__version__, nodes=tuple(dict.fromkeys(c.node for c in contexts)), matrix=matrix,
        fallbacks=fallback_results, fallback_choices=choices, bandwidth=rows, option_mapping=mapping,
        created_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    )


def write_outputs(result: CommResult, out_dir: Path, *, json_path: Path | None = None,
                  source: CommResult | None = None) -> tuple[dict[str, str], Comparison | None, str]:
    """Write result.json (or ``json_path``), matrix.csv, bandwidth.csv, bandwidth.png and comm.md.

    Returns (name -> path, the comparison with ``source`` if given, the Markdown text).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, str] = {}
    paths["result"] = str(write_json(result, json_path or out_dir / "comm_result.json"))
    if result.matrix is not None:
        (out_dir / "matrix.csv").write_text(matrix_csv(result.matrix))
        paths["matrix_csv"] = str(out_dir / "matrix.csv")
    if result.bandwidth:
        (out_dir / "bandwidth.csv").write_text(bandwidth_csv(result.bandwidth))
        paths["bandwidth_csv"] = str(out_dir / "bandwidth.csv")
        paths["bandwidth_png"] = str(plot_bandwidth(
            result.bandwidth, out_dir / "bandwidth.png",
            title=f"{result.backend} busbw, {result.world_size} ranks ({result.device_type})"))
    comparison = compare_results(source, result) if source is not None else None
    text = markdown(result, comparison_markdown(comparison) if comparison is not None else "")
    (out_dir / "comm.md").write_text(text)
    paths["markdown"] = str(out_dir / "comm.md")
    return paths, comparison, text

"""``migrate convert SRC DST --to FORMAT [--dp N] [--zero-stage S] [--model-config FILE] [...]``: rewrite a
checkpoint for a layout (or another framework)."""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import click

from checkpoint import bounded_yaml
from checkpoint.api import LayoutRequest, WRITABLE_FORMATS, convert, read_index
from checkpoint.formats import FORMAT_ALIASES
from checkpoint.destination import JOB_MANIFEST, Existing
from checkpoint.errors import CheckpointError
from checkpoint.strictness import Strictness
from checkpoint.pools import local_map
from checkpoint.storage import NodePath, Storage
from checkpoint.plan import summarize
from checkpoint.verify import compare_indexes
from migrate.convert_node_local import NodeLocalStorage
from migrate.convert_ray import NodeLostError, RayMap, bytes_by_node
from migrate.progress import LiveStatus

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
POSITIVE = click.IntRange(min=1)


def read_model_config(path: Path) -> dict[str, Any]:
    """The model config in `path`: an HF config.json, a YAML/JSON model section, or a job YAML (its `model`)."""
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else bounded_yaml.load(text)
    except (OSError, ValueError) as exc:  # bounded_yaml.YamlInputError is a ValueError
        raise click.BadParameter(f"{path}: unreadable ({exc})", param_hint="--model-config") from exc
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        data = data["model"]
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path}: holds {type(data).__name__}, not a mapping of model fields",
                                 param_hint="--model-config")
    return data


def _shard_size(text: str | None) -> int | str | None:
    """--max-shard-size as huggingface_hub takes it: a number of bytes, or a size with its unit."""
    return int(text) if text is not None and text.isdigit() else text


@click.command(name="convert", help="Convert the checkpoint SRC into DST (absent or empty) for a target layout.")
@click.argument("src", type=click.Path(path_type=Path, exists=True))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--to", "to", type=click.Choice([*WRITABLE_FORMATS, *FORMAT_ALIASES]), required=True,
              help=f"target format: {', '.join(WRITABLE_FORMATS)}")
@click.option("--dp", type=POSITIVE, default=None, help="target data-parallel size (default: the source's)")
@click.option("--zero-stage", type=click.IntRange(1, 3), default=None, help="target ZeRO stage (default: the source's)")
@click.option("--tp", type=POSITIVE, default=None, help="target tensor-parallel size (default: the source's)")
@click.option("--pp", type=POSITIVE, default=None, help="target pipeline-parallel size (default: the source's)")
@click.option("--ep", type=POSITIVE, default=None, help="target expert-parallel size (default: the source's)")
@click.option("--vpp", type=POSITIVE, default=None,
              help="target virtual pipeline stages per rank (Megatron; default: the source's when pp is kept, else 1)")
@click.option("--first-pipeline-stage-layers", type=POSITIVE, default=None,
              help="decoder layers on the first pipeline rank, the rest even over the middle ranks (Megatron's "
                   "--decoder-first-pipeline-num-layers; default: the source's when pp and vpp are kept, else even)")
@click.option("--last-pipeline-stage-layers", type=POSITIVE, default=None,
              help="decoder layers on the last pipeline rank (Megatron's --decoder-last-pipeline-num-layers; "
                   "default as --first-pipeline-stage-layers)")
@click.option("--dry-run", is_flag=True, help="print the plan (files, bytes per target rank) without reading data")
@click.option("--per-rank", is_flag=True, help="list every target rank and its files (default: summarized beyond 16 ranks)")
@click.option("--verify", is_flag=True, help="re-read the output and compare every tensor with the source")
@click.option("--workers", type=POSITIVE, default=1, show_default=True, help="local processes writing target files")
@click.option("--ray-address", default=None,
              help="write target files as Ray tasks on this cluster ('embedded', 'auto', HOST:PORT); "
                   "default: --workers local processes")
@click.option("--storage", type=click.Choice(["shared", "node-local"]), default="shared", show_default=True,
              help="with --ray-address: shared = DST is one folder every node sees (a shared file system); "
                   "node-local = each node keeps the files its tasks wrote under DST on its own disk ($VAR in DST "
                   "expands on each node), the driver writes DST/manifest.nodes.json listing every node's files")
@click.option("--arch", default=None, help="HF name map for --to hf (llama, mixtral, gpt; default: the config's)")
@click.option("--max-shard-size", default=None,
              help="--to hf: the largest safetensors shard, as save_pretrained takes it ('5GB', '500MB', bytes; "
                   "default 50GB); several shards get model.safetensors.index.json")
@click.option("--dcp-layout", type=click.Choice(["nested", "torchtitan"]), default=None,
              help="--to dcp: FSDP2's nested model/optimizer state (default) or torchtitan's CheckpointManager layout "
                   "(model keys at the top level, flattened optimizer state, train_state)")
@click.option("--param-names", type=click.Choice(["canonical", "hf", "torchtitan"]), default=None,
              help="--to dcp or deepspeed: the parameter-name convention written (default: the source's): "
                   "transformers' module names (deepspeed: in the model class's parameter order, a Trainer "
                   "checkpoint-N folder), torchtitan's Llama names (dcp; wq/wk rows in its RoPE order) or the "
                   "built-in decoder's")
@click.option("--model-config", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="the architecture when the source does not record it, or to override what it records (each "
                   "overridden field is named): an HF config.json (llama/mixtral/starcoder2 keys) or a job YAML (its "
                   "model section)")
@click.option("--strict", type=click.Choice([s.value for s in Strictness]), default=Strictness.REPORT.value,
              show_default=True,
              help="state that would not pass unchanged: report lists it (the optimizer a conversion to hf drops); "
                   "refuse-loss refuses when any source state would not reach the target; refuse-change also "
                   "refuses state the target would hold derived rather than copied (RNG of a rank whose role "
                   "changed). Decided from the plan before anything is written")
@click.option("--trust-checkpoint", is_flag=True, help="allow pickled classes outside the allow-list")
@click.option("--follow-symlinks", is_flag=True,
              help="read through symbolic links that lead outside the source checkpoint (refused by default)")
@click.option("--resume", "resume", is_flag=True,
              help="finish an unfinished conversion into DST (one that crashed), keeping the files it completed")
@click.option("--overwrite", is_flag=True, help="replace an earlier conversion's output in DST (finished or not)")
def command(src: Path, dst: Path, to: str, dp: int | None, zero_stage: int | None, tp: int | None, pp: int | None,
            ep: int | None, vpp: int | None, first_pipeline_stage_layers: int | None, last_pipeline_stage_layers: int | None,
            max_shard_size: str | None, dcp_layout: str | None,
            param_names: str | None,
            dry_run: bool, per_rank: bool, verify: bool, workers: int, ray_address: str | None, storage: str,
            arch: str | None,
            model_config: Path | None, strict: str, trust_checkpoint: bool, follow_symlinks: bool, resume: bool,
            overwrite: bool) -> None:
    if to in FORMAT_ALIASES:
        click.echo(f"note: --to {to} is deprecated, use --to {FORMAT_ALIASES[to]} (accepted until migrate 0.3)", err=True)
        to = FORMAT_ALIASES[to]
    if resume and overwrite:
        raise click.UsageError("--resume and --overwrite exclude each other: finish the earlier conversion or "
                               "replace it")
    node_local = storage == "node-local"
    if node_local and ray_address is None:
        raise click.UsageError("--storage node-local writes on the nodes of a Ray cluster: give --ray-address")
    if node_local and verify:
        raise click.UsageError("--verify re-reads DST on this machine; with --storage node-local the files are on "
                               "the nodes' disks (each node's manifest.json lists and checks its own)")
    existing = Existing.RESUME if resume else Existing.OVERWRITE if overwrite else Existing.REFUSE
    config = None if model_config is None else read_model_config(model_config)
    destination: Storage | None = None
    with ExitStack() as stack:
        map_fn = local_map(workers)
        if ray_address is not None and not dry_run:
            from migrate.convert_ray import ray_map
            from migrate.runtime.ray_cluster import connect

            stack.enter_context(connect(ray_address, num_cpus=max(workers, 1)))
            map_fn = ray_map(max_in_flight=max(workers, 1), shared=(src,) if node_local else (src, dst))
            if node_local:
                destination = NodeLocalStorage(map_fn)
        phases = LiveStatus("convert", dest=dst)
        try:
            outcome = convert(src, dst, to=to, target=LayoutRequest(dp=dp, tp=tp, pp=pp, ep=ep, vpp=vpp,
                                                                     zero_stage=zero_stage,
                                                                     first_pipeline_stage_layers=first_pipeline_stage_layers,
                                                                     last_pipeline_stage_layers=last_pipeline_stage_layers),
                              strict=Strictness(strict), arch=arch, model_config=config,
                              max_shard_size=_shard_size(max_shard_size), dcp_layout=dcp_layout,
                              param_names=param_names, dry_run=dry_run, map_fn=map_fn, trust_checkpoint=trust_checkpoint,
                              follow_symlinks=follow_symlinks, existing=existing, phase=phases,
                              storage=destination)
        except NodeLostError as exc:  # not bad input: the cluster lost what it was writing
            phases.close(last="")  # the error is the last line
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_FAILED)
        except CheckpointError as exc:
            phases.close(last="")
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except KeyboardInterrupt:
            phases.close(last="")
            click.echo(f"interrupted: {dst} holds an unfinished conversion; rerun the same command with --resume "
                       f"to finish it, or with --overwrite to start over", err=True)
            sys.exit(130)
        finally:
            phases.close()
    for field in outcome.plan.source.meta.get("arch_overrides") or ():
        click.echo(f"--model-config overrides the checkpoint's {field}")
    click.echo(summarize(outcome.plan, per_rank=per_rank))
    if outcome.differences:
        click.echo(f"state not passed unchanged (--strict {strict}):")
        for d in outcome.differences:
            click.echo(f"  {d.describe()}")
    if outcome.result is None:
        return
    r = outcome.result
    kept = f" ({r.resumed} kept from the unfinished run)" if r.resumed else ""
    click.echo(f"wrote {len(r.files)} files{kept}, {r.nbytes / 2**20:.2f} MiB in {r.seconds:.2f} s to {dst}")
    if isinstance(map_fn, RayMap) and map_fn.placements:
        nodes = bytes_by_node(outcome.plan, map_fn.placements)
        moved = sum(p.written != p.planned for p in map_fn.placements if p.planned)
        if map_fn.shared_by:
            seen = "the source" if node_local else "the source and the destination"
            click.echo(f"ray: {len(map_fn.shared_by)} node(s) see {seen} as this one does")
        click.echo(f"ray: {len(map_fn.placements)} files written by tasks on {len(nodes)} node(s)"
                   + (f", {moved} on another node than planned (their node was lost)" if moved else ""))
        for n in nodes:
            contiguous = n.ranks == tuple(range(n.ranks[0], n.ranks[-1] + 1)) if n.ranks else False
            ranks = ("shared files" if not n.ranks else f"rank {n.ranks[0]}" if len(n.ranks) == 1 else
                     f"ranks {n.ranks[0]}-{n.ranks[-1]}" if contiguous else f"ranks {', '.join(map(str, n.ranks))}")
            click.echo(f"  node {n.node[:12]}: {ranks}, {n.files} files, read {n.bytes_read / 2**20:.2f} MiB, "
                       f"wrote {n.bytes_written / 2**20:.2f} MiB")
    if isinstance(destination, NodeLocalStorage) and destination.job_manifest:
        held = destination.job_manifest["nodes"]
        click.echo(f"node-local storage: {len(held)} node(s) hold their files under {dst} on their own disks; the "
                   f"list of every node's files is {Path(NodePath(str(dst))) / JOB_MANIFEST} on this machine")
        for node, entry in held.items():
            click.echo(f"  node {node[:12]} ({entry['address']}): {len(entry['files'])} files in {entry['path']}")
    if verify:
        problems = compare_indexes(outcome.plan.source, read_index(dst))
        for p in problems:
            click.echo(f"verify: {p}", err=True)
        click.echo("verify: every tensor equals the source" if not problems else f"verify: {len(problems)} problems")
        sys.exit(EXIT_FAILED if problems else EXIT_OK)

"""Benchmark of the checkpoint converter on real DeepSpeed ZeRO checkpoints of growing size.

For each size it trains a stack of square linears for one step with DeepSpeed (ZeRO-2, fp32 Adam,
dp ranks on Gloo) and saves; then it times, on the same source:
* `copy`: `cp -r` of the checkpoint directory + `sync` (the I/O floor: read all, write all);
* `ours`: `checkpoint.api.convert` in a fresh process (fsync'd files + manifest), for dp 4->3 (ZeRO-2)
  and ZeRO-2 -> ZeRO-3 (dp 4), with that process's peak RSS (VmHWM); the clock starts after the
  process imported `checkpoint.api` (torch), as in a running `migrate` process: that import is
  reported apart (`import_s` in the JSON);
* `universal`: DeepSpeed's path for the same reshard: `ds_to_universal` (once per size: its output does
  not depend on the target) + DeepSpeed's engine loading it with `"checkpoint": {"load_universal":
  true}` at the target layout, against DeepSpeed's plain load of our output (`load_checkpoint` time
  of rank 0 in both; engine construction excluded).
With `--ray-nodes 1,2,4` each conversion is also run over a Ray cluster of that many simulated nodes on
this machine (`ray.cluster_utils.Cluster`: a head without CPUs and N raylets sharing the machine's CPUs),
through `migrate.convert_ray.ray_map` (each target rank's files written by a task on its node); the
cluster is started and its workers have imported the converter before the clock starts, as a running
cluster would be, and the peak RSS reported is the largest of the task workers'.
Copies and conversions are timed `--repeat` times (default 3), alternating so that both see the same
load of a shared machine; the medians are reported. It prints one table and a verdict per target; `--json` also
writes every number. Targets (issue 4):
* vs copy: ours >= 0.8x the copy's throughput, i.e. copy seconds / our seconds >= 0.8 (same bytes),
  and the multi-node issue's >= 1.0x (at the disk's limit), local and on every Ray node count;
* vs universal: DeepSpeed's path for the same reshard (ds_to_universal + its universal load, where
  the resharding happens) takes >= 5x as long as our conversion. Also printed, not the target: the
  end-to-end ratio with DeepSpeed's plain load of our output added to our side;
* memory: peak RSS <= 2x the largest tensor + 400 MB, and flat (within 24 MiB) as the checkpoint grows.

Defaults are 1, 2, 4 and 8 GB. Building the source takes the memory of four training ranks: about 6 GB
at 4 GB, 23 GB at 8 GB (each rank peaks near 5.8 GB; DeepSpeed's buckets are shrunk for it, see
`_config`), so 8 GB needs an otherwise idle 24 GB machine (check `free -g` first), and three times the
checkpoint's size on disk.
Run: `.venv/bin/python scripts/bench_convert.py [--sizes-gb 1,2,4,8] [--ray-nodes 1,2,4] [--work DIR]
[--json PATH]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
HIDDEN = 2048
TAG = "global_step1"
BYTES_PER_PARAM = 16  # ZeRO-2 fp32 + Adam: module 4 + fp32 master 4 + exp_avg 4 + exp_avg_sq 4


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One conversion measured: what, how long, how much memory."""

    size_gb: float
    conversion: str
    nodes: int  # 0: the local pool of the converting process; N: Ray tasks on N simulated nodes
    source_bytes: int
    largest_tensor_bytes: int
    copy_s: float
    ours_s: float
    ours_import_s: float
    ours_peak_rss_bytes: int
    ours_load_s: float | None
    universal_convert_s: float | None
    universal_load_s: float | None
    universal_note: str = ""

    @property
    def copy_ratio(self) -> float:
        """Our throughput relative to the copy's (1.0: as fast as cp -r + sync)."""
        return self.copy_s / self.ours_s

    @property
    def universal_ratio(self) -> float | None:
        """The issue's ratio: (ds_to_universal + DeepSpeed's universal load, which does the reshard) / our
        conversion time."""
        if self.universal_convert_s is None or self.universal_load_s is None:
            return None
        return (self.universal_convert_s + self.universal_load_s) / self.ours_s

    @property
    def end_to_end_ratio(self) -> float | None:
        """The same with DeepSpeed's plain load of our output added to our side: both paths ending in an
        engine holding the resharded state (stricter than the issue's ratio; reported, not the target)."""
        if self.universal_ratio is None or self.ours_load_s is None:
            return None
        return (self.universal_convert_s + self.universal_load_s) / (self.ours_s + self.ours_load_s)

    @property
    def rss_bound_bytes(self) -> int:
        return 2 * self.largest_tensor_bytes + (400 << 20)


# ---------------------------------------------------------------- DeepSpeed ranks (spawned)

def layers_for(size_gb: float, hidden: int = HIDDEN) -> int:
    """Square linears (with bias) whose ZeRO-2 fp32 Adam checkpoint is about `size_gb` GB."""
    return max(1, round(size_gb * 1e9 / (BYTES_PER_PARAM * (hidden * hidden + hidden))))


def _model(layers: int, hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden) for _ in range(layers)))


def _config(stage: int, universal: bool) -> dict:
    # buckets of 5e7 elements (200 MB) instead of DeepSpeed's 5e8 (2 GB each, per rank): what lets four ranks
    # build an 8 GB checkpoint in 24 GB; the checkpoint's content does not depend on them
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7}}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _rank(rank: int, world: int, init_file: str, job: dict) -> None:
    """Build (train one step, save) or load a checkpoint; rank 0 writes its timings to job['out']."""
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=job["port"])
        torch.set_num_threads(1)
        torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        import deepspeed

        torch.manual_seed(0)
        model = _model(job["layers"], job["hidden"])
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # torch's Adam: the step is a tensor
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config=_config(job["stage"], job.get("universal", False)))
        out: dict = {}
        if job["mode"] == "build":
            x = torch.randn(2, job["hidden"], generator=torch.Generator().manual_seed(rank))
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            engine.save_checkpoint(job["dir"], tag=TAG)
        else:
            torch.distributed.barrier()
            start = time.perf_counter()
            path, _ = engine.load_checkpoint(job["dir"], tag=None)
            torch.distributed.barrier()
            out["load_s"] = time.perf_counter() - start
            if path is None:
                raise RuntimeError(f"DeepSpeed loaded nothing from {job['dir']}")
        if rank == 0:
            Path(job["out"]).write_text(json.dumps(out))
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException:
        Path(f"{job['out']}.rank{rank}.err").write_text(traceback.format_exc())
        raise


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def launch(world: int, job: dict, timeout_s: float = 900) -> dict:
    """Run `_rank` at `world` ranks; rank 0's result. Judged by what rank 0 wrote (a rank aborting at
    exit after its work, seen with Gloo, is not a failure)."""
    import torch.multiprocessing as mp

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory(prefix="bench_rdzv_") as tmp:
        job = {**job, "port": _free_port(), "out": str(Path(tmp, "rank0.json"))}
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, world, str(Path(tmp, "init")), job)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join()
        if not Path(job["out"]).exists():
            errs = "\n".join(p.read_text() for p in Path(tmp).glob("*.err"))
            raise RuntimeError(f"DeepSpeed {job['mode']} at {world} ranks failed (exit codes "
                               f"{[p.exitcode for p in procs]}):\n{errs}")
        return json.loads(Path(job["out"]).read_text())


def build_checkpoint(directory: Path, *, size_gb: float, dp: int, stage: int = 2, hidden: int = HIDDEN) -> Path:
    """Train the linear stack one step at `dp` ranks and save a real DeepSpeed checkpoint into `directory`."""
    launch(dp, {"mode": "build", "dir": str(directory), "layers": layers_for(size_gb, hidden), "hidden": hidden,
                "stage": stage})
    return directory


# ---------------------------------------------------------------- measurements

def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def timed_copy(src: Path, dst: Path) -> float:
    """Seconds of `cp -r src dst` + `sync`, from a clean page cache (the source's own writes flushed first)."""
    subprocess.run(["sync"], check=True)
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - start


# Peak RSS is this process's own high-water mark (VmHWM): getrusage's ru_maxrss would also count the
# parent's, which Linux carries into a child across fork/vfork + exec.
_CONVERT = """
import time
t0 = time.perf_counter()
import json, sys
from checkpoint.api import LayoutRequest, convert
a = json.loads(sys.argv[1])
map_fn, cluster, worker_rss = None, None, []
if a["nodes"]:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from migrate.convert_ray import alive_nodes, ray_map

    def _hwm(hold=0.0):
        import checkpoint.api  # noqa: F401 - the converter and its formats, as in a worker that converted before
        time.sleep(hold)  # held: every CPU of the node gets a worker of its own
        hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
        return int(hwm.split()[1]) * 1024

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(a["nodes"]):
        cluster.add_node(num_cpus=a["cpus_per_node"])
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    probe = ray.remote(num_cpus=1)(_hwm)
    on = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)) for n in alive_nodes()]
    ray.get([task.remote(1.0) for task in on for _ in range(a["cpus_per_node"])])
    map_fn = ray_map()
start = time.perf_counter()
convert(a["src"], a["dst"], to=a["to"], target=LayoutRequest(dp=a["dp"], zero_stage=a["stage"]), map_fn=map_fn)
seconds = time.perf_counter() - start
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
peak = int(hwm.split()[1]) * 1024
if cluster is not None:
    peak = max(ray.get([task.remote() for task in on]))
    ray.shutdown()
    cluster.shutdown()
print(json.dumps({"seconds": seconds, "import_seconds": start - t0, "peak_rss": peak}))
"""


def convert_in_subprocess(src: Path, dst: Path, *, to: str = "deepspeed", dp: int | None,
                          stage: int | None, with_import: bool = False, nodes: int = 0) -> tuple[float, ...]:
    """(seconds, peak RSS bytes[, seconds importing checkpoint.api]) of `checkpoint.api.convert` in a
    fresh Python process; with `nodes`, over Ray tasks on that many simulated nodes (peak RSS: the
    largest task worker's)."""
    cpus_per_node = max(1, (os.cpu_count() or 1) // max(nodes, 1))
    args = json.dumps({"src": str(src), "dst": str(dst), "to": to, "dp": dp, "stage": stage, "nodes": nodes,
                       "cpus_per_node": cpus_per_node})
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _CONVERT, args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"convert {src} -> {dst} failed:\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if with_import:
        return out["seconds"], out["peak_rss"], out["import_seconds"]
    return out["seconds"], out["peak_rss"]


def ds_to_universal(src: Path, out_tag_dir: Path) -> float:
    """Seconds of DeepSpeed's own converter (2 extract workers, 1 merge worker: a 2-core machine)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(src / TAG), "--output_folder", str(out_tag_dir), "--num_extract_workers", "2",
                           "--num_merge_workers", "1", "--inject_missing_state"],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"ds_to_universal failed:\n{proc.stderr[-4000:]}")
    return time.perf_counter() - start


def load_seconds(directory: Path, *, dp: int, stage: int, layers: int, hidden: int, universal: bool) -> float:
    return launch(dp, {"mode": "load", "dir": str(directory), "layers": layers, "hidden": hidden, "stage": stage,
                       "universal": universal})["load_s"]


def bench_size(size_gb: float, work: Path, *, dp: int, to_dp: int, hidden: int, universal: bool,
               repeat: int = 1, ray_nodes: tuple[int, ...] = ()) -> list[Case]:
    """Build one source of `size_gb` and measure both conversions on it."""
    root = work / f"{size_gb:g}gb"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    layers = layers_for(size_gb, hidden)
    print(f"[{size_gb:g} GB] building a ZeRO-2 dp{dp} checkpoint ({layers} x Linear({hidden}, {hidden}))", flush=True)
    src = build_checkpoint(root / "src", size_gb=size_gb, dp=dp, hidden=hidden)
    nbytes = dir_bytes(src)
    largest = hidden * hidden * 4
    print(f"[{size_gb:g} GB] source {nbytes / 1e9:.2f} GB; copy", flush=True)
    copies = [timed_copy(src, root / "copy")]
    shutil.rmtree(root / "copy")
    uni_s, note = None, ""
    if universal:
        print(f"[{size_gb:g} GB] ds_to_universal", flush=True)
        uni_dir = root / "universal" / f"{TAG}_universal"
        uni_s = ds_to_universal(src, uni_dir)
        # DeepSpeed's ZeRO-3 engine looks for zero_pp_rank_0_mp_rank_00_model_states.pt, which
        # ds_to_universal does not write for a ZeRO-1/2 source: link it under that name too
        os.link(uni_dir / "mp_rank_00_model_states.pt", uni_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    cases = []
    for name, to_layout in ((f"dp{dp}->dp{to_dp} z2", (to_dp, 2)), (f"z2->z3 dp{dp}", (dp, 3))):
        for nodes in (0, *ray_nodes):
            where = f" on {nodes} Ray node(s)" if nodes else ""
            print(f"[{size_gb:g} GB] ours {name}{where}", flush=True)
            dst = root / f"ours_{to_layout[0]}_{to_layout[1]}"
            runs = []
            for r in range(repeat):  # copy and ours alternate, so both see the same machine load
                if r or nodes:
                    shutil.rmtree(dst, ignore_errors=True)
                    copies.append(timed_copy(src, root / "copy"))
                    shutil.rmtree(root / "copy")
                subprocess.run(["sync"], check=True)  # start from the same clean page cache as the copy did
                runs.append(convert_in_subprocess(src, dst, dp=to_layout[0], stage=to_layout[1], with_import=True,
                                                  nodes=nodes))
            ours_s, rss, import_s = sorted(runs)[len(runs) // 2]
            copy_s = sorted(copies)[len(copies) // 2]
            ours_load = uni_load = None
            if universal and not nodes:
                print(f"[{size_gb:g} GB] DeepSpeed loads ours / the universal checkpoint at {name}", flush=True)
                ours_load = load_seconds(dst, dp=to_layout[0], stage=to_layout[1], layers=layers, hidden=hidden,
                                         universal=False)
                try:
                    uni_load = load_seconds(root / "universal", dp=to_layout[0], stage=to_layout[1], layers=layers,
                                            hidden=hidden, universal=True)
                except RuntimeError as err:
                    note = f"universal load failed: {str(err).strip().splitlines()[-1][:160]}"
            shutil.rmtree(dst)
            cases.append(Case(size_gb=size_gb, conversion=name, nodes=nodes, source_bytes=nbytes,
                              largest_tensor_bytes=largest, copy_s=copy_s, ours_s=ours_s, ours_import_s=import_s,
                              ours_peak_rss_bytes=rss, ours_load_s=ours_load,
                              universal_convert_s=uni_s if not nodes else None, universal_load_s=uni_load,
                              universal_note=note))
            note = ""
    shutil.rmtree(root, ignore_errors=True)
    return cases


def table(cases: list[Case]) -> str:
    """The one table: time vs copy, vs the universal path, and peak RSS vs the largest tensor."""
    head = ("| size | conversion | nodes | source | copy s | ours s | vs copy | universal s (conv+load) | universal / ours "
            "| ours+load s | universal / (ours+load) | peak RSS | largest tensor | RSS bound |")
    lines = [head, "|" + "---|" * 14]
    for c in cases:
        load = "fail" if c.universal_load_s is None else f"{c.universal_load_s:.1f}"
        uni = "n/a" if c.universal_convert_s is None else f"{c.universal_convert_s:.1f} + {load}"
        ratio = "n/a" if c.universal_ratio is None else f"{c.universal_ratio:.1f}x"
        e2e = "n/a" if c.end_to_end_ratio is None else f"{c.end_to_end_ratio:.1f}x"
        ours_load = "n/a" if c.ours_load_s is None else f"{c.ours_s:.1f} + {c.ours_load_s:.1f}"
        lines.append(f"| {c.size_gb:g} GB | {c.conversion} | {c.nodes or 'local'} | {c.source_bytes / 1e9:.2f} GB | "
                     f"{c.copy_s:.2f} | "
                     f"{c.ours_s:.2f} | {c.copy_ratio:.2f}x | {uni} | {ratio} | {ours_load} | {e2e} | "
                     f"{c.ours_peak_rss_bytes / 2**20:.0f} MiB | {c.largest_tensor_bytes / 2**20:.0f} MiB | "
                     f"{c.rss_bound_bytes / 2**20:.0f} MiB |")
    notes = [f"  {c.size_gb:g} GB {c.conversion}: {c.universal_note}" for c in cases if c.universal_note]
    return "\n".join(lines + (["notes:"] + notes if notes else []) + ["targets:"] + verdicts(cases))


def verdicts(cases: list[Case]) -> list[str]:
    """One line per target of issue 4: met or missed, with the numbers."""
    copy = [c.copy_ratio for c in cases]
    uni = [c.universal_ratio for c in cases if c.universal_ratio is not None]
    over = [c for c in cases if c.ours_peak_rss_bytes > c.rss_bound_bytes]
    by_conv: dict[str, list[Case]] = {}
    for c in cases:
        by_conv.setdefault(c.conversion + (f" ({c.nodes} Ray nodes)" if c.nodes else ""), []).append(c)
    growth = {k: max(c.ours_peak_rss_bytes for c in v) - min(c.ours_peak_rss_bytes for c in v)
              for k, v in by_conv.items()}
    return [
        f"  vs copy >= 0.80x: {'met' if min(copy) >= 0.8 else 'MISSED'} (min {min(copy):.2f}x, max {max(copy):.2f}x)",
        f"  vs copy >= 1.00x (at the disk's limit): {'met' if min(copy) >= 1.0 else 'MISSED'} "
        f"(min {min(copy):.2f}x)",
        "  vs universal >= 5x: " + ("n/a (not measured)" if not uni else f"{'met' if min(uni) >= 5 else 'MISSED'} "
                                                                         f"(min {min(uni):.1f}x, max {max(uni):.1f}x)"),
        f"  peak RSS <= 2x largest + 400 MB: {'met' if not over else 'MISSED'} "
        f"(max {max(c.ours_peak_rss_bytes for c in cases) / 2**20:.0f} MiB)",
        "  flat (<= 24 MiB growth over sizes): " + ", ".join(f"{k} +{v / 2**20:.0f} MiB" for k, v in growth.items()),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-gb", default="1,2,4,8", help="comma-separated checkpoint sizes in GB")
    p.add_argument("--dp", type=int, default=4, help="source data-parallel size (ZeRO-2)")
    p.add_argument("--to-dp", type=int, default=3, help="target dp of the dp-change conversion")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="width of the square linears (largest tensor)")
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one, removed)")
    p.add_argument("--no-universal", action="store_true", help="skip DeepSpeed's universal path (and loads)")
    p.add_argument("--repeat", type=int, default=3, help="copies and conversions timed per case (median kept)")
    p.add_argument("--ray-nodes", default="", help="also convert over Ray tasks on each of these numbers of "
                                                   "simulated nodes, e.g. 1,2,4")
    p.add_argument("--json", default=None, help="also write every measured number to this file")
    args = p.parse_args(argv)
    ray_nodes = tuple(int(n) for n in args.ray_nodes.split(",") if n.strip())
    if any(n < 1 for n in ray_nodes):
        p.error(f"--ray-nodes {args.ray_nodes}: node counts must be >= 1")
    sizes = [float(s) for s in args.sizes_gb.split(",") if s.strip()]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_convert_"))
    start = time.perf_counter()
    try:
        cases = [c for s in sizes for c in bench_size(s, work, dp=args.dp, to_dp=args.to_dp, hidden=args.hidden,
                                                     repeat=args.repeat, ray_nodes=ray_nodes,
                                                     universal=not args.no_universal)]
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(table(cases))
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(c) | {"copy_ratio": c.copy_ratio,
                                                            "universal_ratio": c.universal_ratio,
                                                            "end_to_end_ratio": c.end_to_end_ratio}
                                               for c in cases], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

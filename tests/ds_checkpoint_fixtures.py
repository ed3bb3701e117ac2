"""Real DeepSpeed ZeRO checkpoints for the conversion tests, made by a small real training run.

`make_deepspeed_checkpoint(spec, root)` trains a tiny model with `deepspeed.initialize` at
`spec.world_size` ranks (processes forked from the fork server, Gloo, file:// rendezvous), saves a checkpoint and
returns its directory. `load_and_probe(ckpt_dir, spec)` loads a checkpoint with DeepSpeed's own
engine at another layout and returns, per parameter, the full fp32 master, exp_avg and exp_avg_sq
that DeepSpeed gathers itself, the step, scheduler and client state, the probe loss before and
after one more training step.

Launch verdicts follow what ranks wrote, not the exit code alone: a rank that aborts at exit after
writing its result (seen with Gloo now and then) is reported, not failed.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

PROBE_SEED = 1234
HIDDEN = 13  # odd sizes give uneven partitions and alignment padding


@dataclass(frozen=True, kw_only=True, slots=True)
class DSCheckpointSpec:
    """What to train: ZeRO stage, dp world size, precision, optimizer and steps."""

    world_size: int
    stage: int
    dtype: str = "fp32"  # fp32 | bf16 | fp16
    optimizer: str = "adam"  # adam | adamw (torch's, passed in) | ds_adam | ds_adamw (built by DeepSpeed from
    # its config: FusedAdam) | ds_cpu_adam (config-built with the optimizer offloaded: DeepSpeedCPUAdam)
    steps: int = 3
    seed: int = 7
    tag: str = "global_step3"
    model: str = "tiny"  # tiny (TinyNet) | tied_frozen (TiedFrozenNet)
    grad_accum: str = ""  # "fp32" with bf16 at ZeRO-1: DeepSpeed's BF16_Optimizer (its data_types.grad_accum_dtype)

    @property
    def name(self) -> str:
        suffix = "" if self.model == "tiny" else f"_{self.model}"
        suffix += f"_acc{self.grad_accum}" if self.grad_accum else ""
        return f"z{self.stage}_dp{self.world_size}_{self.dtype}_{self.optimizer}{suffix}"


class TinyNet(torch.nn.Module):
    """Embedding + two linears + layernorm: odd shapes, a bias, a buffer-free module."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(17, HIDDEN)
        self.fc1 = torch.nn.Linear(HIDDEN, 2 * HIDDEN + 1)
        self.norm = torch.nn.LayerNorm(2 * HIDDEN + 1)
        self.fc2 = torch.nn.Linear(2 * HIDDEN + 1, 17)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = torch.nn.functional.gelu(self.fc1(h))
        logits = self.fc2(self.norm(h)).float()
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 17), tokens[:, 1:].reshape(-1))


class TiedFrozenNet(torch.nn.Module):
    """TinyNet's shapes with the output layer tied to the embedding (DeepSpeed's `shared_params`) and
    fc1 frozen (`requires_grad=False`: no optimizer state; ZeRO-2/3's `frozen_param_shapes`/`_fragments`)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(17, HIDDEN)
        self.fc1 = torch.nn.Linear(HIDDEN, 2 * HIDDEN + 1)
        self.norm = torch.nn.LayerNorm(2 * HIDDEN + 1)
        self.fc2 = torch.nn.Linear(2 * HIDDEN + 1, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, 17, bias=False)
        self.head.weight = self.embed.weight
        self.fc1.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(self.embed(tokens)))
        logits = self.head(self.fc2(self.norm(h))).float()
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 17), tokens[:, 1:].reshape(-1))


MODELS = {"tiny": TinyNet, "tied_frozen": TiedFrozenNet}


def ds_config(stage: int, dtype: str, universal: bool = False, optimizer: str = "adam",
              grad_accum: str = "") -> dict[str, Any]:
    """The DeepSpeed config both the source run and the verifying load use (`universal`: load a
    universal checkpoint; an `optimizer` starting with `ds_` is built by DeepSpeed from this config)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5}},
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
    }
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    if grad_accum:
        cfg["data_types"] = {"grad_accum_dtype": grad_accum}
    if optimizer.startswith("ds_"):
        cfg["optimizer"] = {"type": "AdamW" if optimizer == "ds_adamw" else "Adam",
                            "params": {"lr": 0.01, "weight_decay": 0.01 if optimizer == "ds_adamw" else 0.0}}
    if optimizer == "ds_cpu_adam":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 17, (2, 9), generator=g)


def _probe_batch() -> torch.Tensor:
    return torch.randint(0, 17, (2, 9), generator=torch.Generator().manual_seed(PROBE_SEED))


def _engine(stage: int, dtype: str, optimizer: str, seed: int, universal: bool = False, model: str = "tiny",
            grad_accum: str = ""):
    import deepspeed

    torch.manual_seed(seed)
    module = MODELS[model]()
    trainable = [p for p in module.parameters() if p.requires_grad]
    config = ds_config(stage, dtype, universal, optimizer, grad_accum)
    if optimizer.startswith("ds_"):
        engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=trainable, config=config)
        return engine
    opt_cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    opt = opt_cls(trainable, lr=0.01, weight_decay=0.01 if optimizer == "adamw" else 0.0)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=config)
    return engine


def _probe_loss(engine) -> float:
    with torch.no_grad():
        return float(engine(_probe_batch().to(engine.device)))


def _init_process(rank: int, world_size: int, init_file: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
    )
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)


def _train_rank(rank: int, world_size: int, init_file: str, spec_d: dict, out_dir: str, result_dir: str) -> None:
    try:
        _init_process(rank, world_size, init_file)
        spec = DSCheckpointSpec(**spec_d)
        engine = _engine(spec.stage, spec.dtype, spec.optimizer, spec.seed, model=spec.model,
                         grad_accum=spec.grad_accum)
        losses = []
        for step in range(spec.steps):
            loss = engine(_batch(rank, step))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        engine.save_checkpoint(out_dir, tag=spec.tag, client_state={"data_position": 6 * spec.steps, "note": "fixture"})
        result = {"losses": losses, "probe_loss": _probe_loss(engine),
                  "optimizer_class": type(engine.optimizer.optimizer).__name__,
                  "wrapper_class": type(engine.optimizer).__name__}
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps(result))
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException:
        Path(result_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _full_state(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Per trained param its full fp32 master and Adam moments; per frozen param its full value ("frozen")."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # ZeRO 1/2 link optimizer-state fragments lazily (at the first step)
        link()
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            with deepspeed.zero.GatheredParameters([p]):
                out[name] = {"frozen": p.data.detach().clone().float().cpu()}
            continue
        out[name] = {
            "fp32": safe_get_full_fp32_param(p).detach().clone().cpu(),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").detach().clone().cpu(),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").detach().clone().cpu(),
        }
    return out


def _load_rank(rank: int, world_size: int, init_file: str, ckpt_dir: str, tag: str, stage: int, dtype: str,
               optimizer: str, result_dir: str, universal: bool = False, model: str = "tiny",
               grad_accum: str = "") -> None:
    try:
        _init_process(rank, world_size, init_file)
        # another seed: the load must overwrite every tensor, frozen params included
        engine = _engine(stage, dtype, optimizer, seed=99, universal=universal, model=model, grad_accum=grad_accum)
        _, client = engine.load_checkpoint(ckpt_dir, tag=None if universal else tag)
        if client is None:
            raise RuntimeError(f"DeepSpeed could not load {ckpt_dir} tag {tag}")
        state = _full_state(engine)
        steps = {
            "global_steps": engine.global_steps,
            "optimizer_step": [float(s["step"]) for s in engine.optimizer.optimizer.state.values() if "step" in s][:1],
            "optimizer_class": type(engine.optimizer.optimizer).__name__,
            "wrapper_class": type(engine.optimizer).__name__,
            "optimizer_step_type": [type(s["step"]).__name__ for s in engine.optimizer.optimizer.state.values()
                                    if "step" in s][:1],
            "lr": [g["lr"] for g in engine.optimizer.param_groups],
            "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "client": {k: v for k, v in client.items() if k in ("data_position", "note")},
        }
        probe = _probe_loss(engine)
        loss = engine(_batch(rank, 100))
        engine.backward(loss)
        engine.step()
        after = _probe_loss(engine)
        if rank == 0:
            torch.save({"state": state, "meta": steps, "probe_loss": probe, "probe_after_step": after},
                       Path(result_dir, "rank0.pt"))
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps({"probe_loss": probe}))
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException:
        Path(result_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_environ(environ: dict, fn, *args) -> None:
    """`fn(*args)` with the driver's environment (a forked process has the fork server's)."""
    os.environ.clear()
    os.environ.update(environ)
    fn(*args)


def _launch(fn, world_size: int, args: tuple, result_dir: Path) -> list[str]:
    """Spawn `fn(rank, world_size, init_file, *args)` per rank; return notes about abnormal exits.

    Raises RuntimeError with every rank's traceback when a rank did not write its result.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["MASTER_PORT"] = str(_free_port())
    with tempfile.TemporaryDirectory(prefix="ds_rdzv_") as tmp:
        init_file = str(Path(tmp, "init"))
        # forked from the session's fork server (torch and DeepSpeed imported once; tests/conftest.py)
        ctx = mp.get_context("forkserver")
        environ = dict(os.environ)
        procs = [ctx.Process(target=_with_environ, args=(environ, fn, r, world_size, init_file, *args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        notes = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                notes.append(f"rank {r} timed out and was killed")
            elif p.exitcode != 0:
                notes.append(f"rank {r} exited with code {p.exitcode}")
    errors = {r: Path(result_dir, f"rank{r}.err") for r in range(world_size)}
    missing = [r for r in range(world_size) if not Path(result_dir, f"rank{r}.json").exists()]
    if missing:
        details = "\n".join(f"--- rank {r}:\n{errors[r].read_text() if errors[r].exists() else '(no traceback)'}"
                            for r in missing)
        raise RuntimeError(f"DeepSpeed launch at world size {world_size} failed on ranks {missing}; {notes}\n{details}")
    return notes


def make_deepspeed_checkpoint(spec: DSCheckpointSpec, root: Path) -> Path:
    """Train `spec` for real and save; returns the checkpoint directory (holding `latest` and the tag)."""
    out = Path(root) / spec.name
    result_dir = Path(root) / f"{spec.name}.results"
    result_dir.mkdir(parents=True, exist_ok=True)
    _launch(_train_rank, spec.world_size, (asdict(spec), str(out), str(result_dir)), result_dir)
    results = json.loads(Path(result_dir, "rank0.json").read_text())
    Path(out, "fixture.json").write_text(json.dumps({"spec": asdict(spec), **results}))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadedState:
    """What DeepSpeed itself holds after loading a checkpoint (rank 0's gathered view)."""

    params: dict[str, dict[str, torch.Tensor]]
    meta: dict[str, Any]
    probe_loss: float
    probe_after_step: float
    launch_notes: tuple[str, ...]


def load_and_probe(ckpt_dir: Path, *, world_size: int, stage: int, dtype: str, optimizer: str = "adam",
                   tag: str = "global_step3", work: Path, universal: bool = False, model: str = "tiny",
                   grad_accum: str = "") -> LoadedState:
    """Load `ckpt_dir` with DeepSpeed at (world_size, stage), gather its state, train one step.

    `universal`: load with `"checkpoint": {"load_universal": true}` (the tag from `latest_universal`)."""
    result_dir = Path(work)
    result_dir.mkdir(parents=True, exist_ok=True)
    notes = _launch(_load_rank, world_size,
                    (str(ckpt_dir), tag, stage, dtype, optimizer, str(result_dir), universal, model, grad_accum),
                    result_dir)
    blob = torch.load(Path(result_dir, "rank0.pt"), weights_only=True)
    return LoadedState(params=blob["state"], meta=blob["meta"], probe_loss=blob["probe_loss"],
                       probe_after_step=blob["probe_after_step"], launch_notes=tuple(notes))


def universal_reference(ckpt_dir: Path, out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Per param fp32 / exp_avg / exp_avg_sq as DeepSpeed's own ds_to_universal extracts them."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint import ds_to_universal

    root = Path(ckpt_dir)
    tag_dir = root / (root / "latest").read_text().strip() if (root / "latest").exists() else root
    args = argparse.Namespace(input_folder=str(tag_dir), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal.main(args)
    ref: dict[str, dict[str, torch.Tensor]] = {}
    for param_dir in sorted(d for d in Path(out, "zero").iterdir() if d.is_dir()):
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            blob = torch.load(param_dir / f"{kind}.pt", weights_only=True)
            ref.setdefault(param_dir.name, {})[kind] = blob["param"] if isinstance(blob, dict) else blob
    return ref


def zero_to_fp32_reference(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights as DeepSpeed's own zero_to_fp32 extracts them."""
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir)))


@pytest.fixture(scope="session")
def deepspeed_checkpoints(tmp_path_factory):
    """Session factory: `get(spec) -> checkpoint dir`, each spec trained once per test run (the xdist workers
    share it: `built_once`)."""
    from workload_fixtures import built_once  # here, not at the top: the spawned ranks import this module

    made: dict[DSCheckpointSpec, Path] = {}

    def get(spec: DSCheckpointSpec) -> Path:
        if spec not in made:
            made[spec] = built_once(tmp_path_factory, f"ds_sources_{spec.name}_s{spec.steps}_seed{spec.seed}_{spec.tag}",
                                    lambda folder: make_deepspeed_checkpoint(spec, folder))
        return made[spec]

    return get


if __name__ == "__main__":  # manual: python tests/ds_checkpoint_fixtures.py ROOT WS STAGE DTYPE
    root, ws, stage, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    print(make_deepspeed_checkpoint(DSCheckpointSpec(world_size=ws, stage=stage, dtype=dtype), Path(root)))

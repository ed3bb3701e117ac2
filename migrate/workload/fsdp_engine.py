"""The built-in decoder trained with PyTorch FSDP2 (`fully_shard`) and, at tp > 1, DTensor tensor
parallelism, checkpointed with DCP, torchtitan-style (`<save_dir>/step-<N>/`), on a worker group.

Per rank: build the decoder -> 2-D ("dp", "tp") device mesh -> at tp > 1 `parallelize_module`
with `tensor_parallel.tp_plan` on the tp axis (sequence parallel norms when
`spec.sequence_parallel`) -> `fully_shard` each layer and the root on the dp axis (bf16 params
with fp32 reductions when precision is bf16) -> AdamW -> optional `dcp.load` -> steps ->
`dcp.save` of {"model", "optimizer", "lr_scheduler", "migrate"} where "migrate" holds the
sampler state and the step (the layout is in the chunks' geometry). DCP's own load reshards,
so a checkpoint written at one (dp, tp) loads at any other. The ranks of one TP group read the
same micro-batches (rank = dp_rank * tp + tp_rank).

On Gloo (torch 2.13, CPU) all of it runs: tp 1/2, dp x tp up to 2 x 2, with and without
sequence parallel; dense models only at tp > 1.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from migrate.workload.data import SamplerState, TokenDataset, rank_micro_batches
from migrate.workload.loop import StepOutcome, train_loop
from migrate.workload.metrics import RankResult, ScheduledLR
from migrate.workload.run_spec import RunSpec
from migrate.workload.tensor_parallel import MeshShape, build_mesh, check_tensor_parallel, parallelize
from migrate.workload.torch_model import build_decoder
from migrate.workload.train_state import StepTrace


def step_dir(save_dir: str, step: int) -> str:
    """torchtitan's checkpoint folder name for step `step`."""
    return os.path.join(save_dir, f"step-{step}")


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: ScheduledLR,
           sampler: SamplerState, step: int, mesh: MeshShape | None) -> dict[str, Any]:
    """The DCP state dict; `mesh` None makes a load template, which leaves out what older and
    converted checkpoints may not hold (the model shape). The (dp, tp) layout is not stored: it is
    in the chunks' geometry (`checkpoint.formats.dcp` reads it there; values would go stale when
    a converter carries them over), and DCP's load reshards to any other layout."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    ours: dict[str, Any] = {"sampler": sampler.state_dict(), "step": step}
    if mesh is not None:
        spec = getattr(model, "spec", None)  # the built-in Decoder's ModelShape: the architecture, for converters
        if spec is not None:
            ours["model"] = dataclasses.asdict(spec)
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer),
            "lr_scheduler": scheduler.state_dict(), "migrate": ours}


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients (DTensor grads on different meshes allowed: the dp-only
    norms and the dp x tp matrices), then clip in place with torch's rule
    (coef = max_norm / (norm + 1e-6), at most 1); returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float32)
    for g in grads:
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares = squares + norm.to("cpu") ** 2
    total = squares.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(float(coef))
    return total


def train_fsdp(ctx: Any, spec: RunSpec) -> RankResult:
    """Per-rank entry point (`ctx` is the worker group's RankContext): train, checkpoint, report."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if spec.engine != "fsdp" or spec.pp != 1 or spec.ep != 1:
        raise ValueError(f"train_fsdp runs engine 'fsdp' with pp=ep=1 (dp x tp), got engine={spec.engine!r} "
                         f"pp({spec.pp}) ep({spec.ep})")
    mesh_shape = MeshShape.of(ctx.world_size, spec.tp)
    check_tensor_parallel(spec.model, spec.tp, spec.sequence_parallel)
    torch.set_num_threads(1)
    train, model_spec = spec.train, spec.model
    dp, rank = mesh_shape.dp, ctx.rank
    dp_rank, _ = mesh_shape.coordinates(rank)
    device = "cpu" if ctx.device_type == "cpu" else ctx.device
    mesh = build_mesh("cpu" if ctx.device_type == "cpu" else ctx.device_type, mesh_shape)
    model = build_decoder(model_spec, train.seed).to(device)
    if spec.tp > 1:
        parallelize(model, mesh["tp"], model_spec, spec.sequence_parallel)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if train.precision == "bf16" else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    opt = train.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                  weight_decay=opt.weight_decay, foreach=False)
    scheduler = ScheduledLR(optimizer, train.lr_schedule, opt.lr)
    sampler = SamplerState(seed=train.seed, dataset_size=train.dataset_size, global_batch_size=train.global_batch_size)
    start_step = 0
    loaded = None
    if spec.load_dir:
        # get_optimizer_state_dict initialises the (empty) Adam state, so DCP has targets to load into.
        state = _state(model, optimizer, scheduler, sampler, 0, None)
        dcp.load(state, checkpoint_id=spec.load_dir)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["lr_scheduler"])
        sampler = SamplerState.from_state_dict(state["migrate"]["sampler"])
        start_step = int(state["migrate"]["step"])
        if spec.print_loaded_state:
            from migrate.workload.state_print import fsdp_state_print

            loaded = fsdp_state_print(model, optimizer, {"lr_scheduler": scheduler.state_dict(), "iteration": start_step,
                                                         "data": sampler.state_dict()}).as_dict()
    dataset = TokenDataset(seed=train.dataset_seed, size=train.dataset_size, seq_length=model_spec.seq_length,
                           vocab_size=model_spec.vocab_size)
    steps = FsdpSteps(model=model, optimizer=optimizer, scheduler=scheduler, spec=spec, dataset=dataset, device=device,
                      mesh=mesh, mesh_shape=mesh_shape, dp_rank=dp_rank)
    return train_loop(ctx, spec, steps, name="fsdp", sampler=sampler, start_step=start_step,
                      trace=StepTrace(enabled=spec.long_run is None), device=device,
                      extra={"dp": dp, "tp": spec.tp, "sequence_parallel": spec.sequence_parallel,
                             "state_print": loaded})


@dataclasses.dataclass(frozen=True, kw_only=True)
class FsdpSteps:
    """`EngineSteps` of an FSDP2 (x DTensor TP) model: torch's AdamW and `ScheduledLR`, gradients averaged over
    the micro-batches and clipped over every mesh, `dcp.save` in torchtitan's `step-<N>` folders."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: ScheduledLR
    spec: RunSpec
    dataset: TokenDataset
    device: str
    mesh: Any
    mesh_shape: MeshShape
    dp_rank: int

    def learning_rate(self, step: int) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def train_step(self, global_indices: Any) -> StepOutcome:
        model, spec = self.model, self.spec
        dp = self.mesh_shape.dp
        micro = rank_micro_batches(global_indices, self.dp_rank, dp, spec.train.micro_batch_size)
        total = torch.zeros((), dtype=torch.float64)
        for indices in micro:
            tokens, labels = self.dataset.batch(indices)
            loss = model(tokens.to(self.device), labels.to(self.device))
            (loss / len(micro)).backward()
            total += loss.detach().to("cpu", torch.float64)
        clip = spec.train.optimizer.clip_grad
        if spec.tp == 1:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        else:  # norms and TP-split params are DTensors on different meshes
            grad_norm = clip_grad_norm(list(model.parameters()), clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        dist.all_reduce(total, group=self.mesh["dp"].get_group())  # the TP ranks of a replica share one loss
        return StepOutcome(loss=float(total) / (dp * len(micro)), grad_norm=float(grad_norm))

    def save(self, step: int, sampler: SamplerState) -> str:
        import torch.distributed.checkpoint as dcp

        path = step_dir(str(self.spec.save_dir), step)
        dcp.save(_state(self.model, self.optimizer, self.scheduler, sampler, step, self.mesh_shape), checkpoint_id=path)
        return path

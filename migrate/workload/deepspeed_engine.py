"""The built-in decoder trained by DeepSpeed (ZeRO 0-3, fp32 or bf16) on a worker group.

Call sequence: the driver starts a worker group (`WorkerGroupSpec(env={"DS_ACCELERATOR":
"cpu"})` on CPUs) and runs `train_deepspeed(ctx, spec)` on every rank; every rank is a DP
rank (DeepSpeed's data parallelism over the whole world). Checkpoints are written with
`engine.save_checkpoint(save_dir, tag="global_step<N>")`; its client state holds the
sampler state and the step count, so `load_dir` resumes with the very next sample.
The optimizer is torch's AdamW selected through the DeepSpeed config (`torch_adam`), so no
fused kernel is compiled; the LR follows `ScheduledLR`, saved by DeepSpeed with the engine.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from migrate.workload.data import SamplerState, TokenDataset, rank_micro_batches
from migrate.workload.loop import StepOutcome, train_loop
from migrate.workload.metrics import RankResult, ScheduledLR
from migrate.workload.run_spec import RunSpec
from migrate.workload.torch_model import build_decoder
from migrate.workload.train_state import CLIENT_STATE_KEY, StepTrace, gather_state, restore_state, seed_rng


def deepspeed_config(spec: RunSpec, dp: int) -> dict[str, Any]:
    """The DeepSpeed config of a run at data-parallel size `dp`; pure."""
    train, opt = spec.train, spec.train.optimizer
    return {
        "train_batch_size": train.global_batch_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accumulation(dp),
        "gradient_clipping": opt.clip_grad,
        "optimizer": {
            "type": "AdamW" if opt.name == "adamw" else "Adam",
            "params": {"lr": opt.lr, "betas": [opt.beta1, opt.beta2], "eps": opt.eps,
                       "weight_decay": opt.weight_decay, "torch_adam": True},
        },
        "bf16": {"enabled": train.precision == "bf16"},
        "zero_optimization": {"stage": spec.zero_stage, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def deepspeed_load_target(path: str) -> tuple[str, str | None]:
    """(checkpoint dir, tag) for `engine.load_checkpoint`: a save dir (its `latest` tag) or one tag dir."""
    if os.path.isfile(os.path.join(path, "latest")):
        return path, None
    if os.path.isfile(os.path.join(path, "mp_rank_00_model_states.pt")) or any(
            name.endswith("_model_states.pt") for name in os.listdir(path)):
        parent, tag = os.path.split(os.path.normpath(path))
        return parent, tag
    raise FileNotFoundError(f"{path}: neither a DeepSpeed save dir (no 'latest' file) nor a tag dir "
                            f"(no *_model_states.pt); it holds {sorted(os.listdir(path))}")


def _set_accelerator(device_type: str) -> None:
    os.environ.setdefault("DS_ACCELERATOR", {"cpu": "cpu", "cuda": "cuda", "npu": "npu"}.get(device_type, device_type))


def train_deepspeed(ctx: Any, spec: RunSpec) -> RankResult:
    """Per-rank entry point (`ctx` is the worker group's RankContext): train, checkpoint, report."""
    if spec.engine != "deepspeed":
        raise ValueError(f"train_deepspeed got a RunSpec for engine {spec.engine!r}")
    if spec.tp != 1 or spec.pp != 1 or spec.ep != 1:
        raise ValueError(f"the DeepSpeed workload is data-parallel only: tp({spec.tp}) pp({spec.pp}) ep({spec.ep}) "
                         "must all be 1")
    _set_accelerator(ctx.device_type)
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    from checkpoint.state.rng import roles

    dp, rank = ctx.world_size, ctx.rank
    train, model_spec = spec.train, spec.model
    role = roles(dp=dp)[rank]
    model = build_decoder(model_spec, train.seed)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=deepspeed_config(spec, dp),
        lr_scheduler=lambda optimizer: ScheduledLR(optimizer, train.lr_schedule, train.optimizer.lr),
    )
    sampler = SamplerState(seed=train.seed, dataset_size=train.dataset_size, global_batch_size=train.global_batch_size)
    start_step = 0
    seed_rng(train.seed, role)
    rng_note = "seeded"
    loaded = None
    if spec.load_dir:
        load_dir, tag = deepspeed_load_target(spec.load_dir)
        path, client = engine.load_checkpoint(load_dir, tag=tag)
        if path is None or not client or CLIENT_STATE_KEY not in client:
            raise FileNotFoundError(f"no DeepSpeed checkpoint with migrate client state under {spec.load_dir} "
                                    f"(loaded path={path}, client keys={sorted(client or {})})")
        sampler, start_step, rng_note = restore_state(client[CLIENT_STATE_KEY], rank=rank, role=role,
                                                      global_batch_size=train.global_batch_size, where=str(path))
        if engine.global_steps != start_step:
            raise RuntimeError(f"{path}: engine.global_steps({engine.global_steps}) != client step({start_step})")
        if spec.print_loaded_state:
            from migrate.workload.state_print import deepspeed_state_print

            loaded = deepspeed_state_print(engine, {"data": sampler.state_dict()}).as_dict()
    device = "cpu" if ctx.device_type == "cpu" else ctx.device
    dataset = TokenDataset(seed=train.dataset_seed, size=train.dataset_size, seq_length=model_spec.seq_length,
                           vocab_size=model_spec.vocab_size)
    steps = DeepSpeedSteps(engine=engine, spec=spec, dataset=dataset, device=device, rank=rank, dp=dp, role=role)
    return train_loop(ctx, spec, steps, name="deepspeed", sampler=sampler, start_step=start_step,
                      trace=StepTrace(enabled=spec.long_run is None), device=device,
                      extra={"rng_restore": rng_note, "state_print": loaded})


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSpeedSteps:
    """`EngineSteps` of a DeepSpeed engine: its own LR scheduler, `engine.backward`/`engine.step` per
    micro-batch (DeepSpeed steps the optimizer at the accumulation boundary), `engine.save_checkpoint`."""

    engine: Any
    spec: RunSpec
    dataset: TokenDataset
    device: str
    rank: int
    dp: int
    role: Any

    def learning_rate(self, step: int) -> float:
        return float(self.engine.get_lr()[0])

    def train_step(self, global_indices: Any) -> StepOutcome:
        engine, train = self.engine, self.spec.train
        skipped_before = engine.skipped_steps
        micro = rank_micro_batches(global_indices, self.rank, self.dp, train.micro_batch_size)
        total = torch.zeros((), dtype=torch.float64)
        for indices in micro:
            tokens, labels = self.dataset.batch(indices)
            loss = engine(tokens.to(self.device), labels.to(self.device))
            engine.backward(loss)
            engine.step()
            total += loss.detach().to("cpu", torch.float64)
        dist.all_reduce(total)
        grad_norm = engine.get_global_grad_norm()
        return StepOutcome(loss=float(total) / (self.dp * len(micro)),
                           grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                           skipped=engine.skipped_steps != skipped_before)

    def save(self, step: int, sampler: SamplerState) -> str:
        train, model_spec, save_dir = self.spec.train, self.spec.model, str(self.spec.save_dir)
        tag = f"global_step{step}"
        state = gather_state(step=step, sampler=sampler, micro_batch_size=train.micro_batch_size, dp=self.dp,
                             role=self.role, consumed_tokens=sampler.consumed_samples * model_spec.seq_length)
        state["model"] = dataclasses.asdict(model_spec)  # the architecture, for converters (Megatron)
        self.engine.save_checkpoint(save_dir, tag=tag, client_state={CLIENT_STATE_KEY: state})
        return os.path.join(save_dir, tag)

"""Real HF-Trainer + DeepSpeed checkpoints, made and judged by `transformers.Trainer` itself.

`save_trainer_checkpoint(run, out)` trains a small `LlamaForCausalLM` (built from a config, no download) with
`Trainer(args=TrainingArguments(deepspeed=<ZeRO config>))` at `run.world_size` processes (Gloo on CPU, with the
environment torchrun gives each process) and returns `out/checkpoint-N` and what DeepSpeed's own accessors
gather at the end of training (the state the checkpoint holds): every parameter's fp32 master and Adam moments.
`trainer_resume(run, checkpoint, world_size)` runs `Trainer.train(resume_from_checkpoint=checkpoint)` at another
world size for one more step and returns what it had restored when that step began (the same gathered
state, the global step, the DeepSpeed scheduler's position) and the step's loss.
The processes are a local worker group's ranks, forked from the test session's server that imported transformers
and DeepSpeed once (a torchrun launch imports them in every process, 10-20 s a launch on two loaded cores).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 97  # odd: Megatron pads it, ZeRO partitions unevenly
CONFIG = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
SEQ = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerRun:
    """One HF-Trainer run: processes, ZeRO stage, precision, optimizer steps before the save."""

    world_size: int = 2
    zero_stage: int = 3
    precision: str = "fp32"  # fp32 | bf16
    steps: int = 3
    config: str = ""  # the model's config.json text (default: CONFIG's LlamaForCausalLM)
    trainer_scheduler: bool = False  # the Trainer's own LR scheduler (saved as scheduler.pt), not DeepSpeed's WarmupLR

    @property
    def name(self) -> str:
        return f"trainer_z{self.zero_stage}_dp{self.world_size}_{self.precision}"


def _ds_config(run: TrainerRun) -> dict[str, Any]:
    """What an HF-Trainer user's ds_config.json holds: "auto" values the Trainer fills in from its arguments."""
    config = {"zero_optimization": {"stage": run.zero_stage}, "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto", "torch_adam": True}},
              "bf16": {"enabled": run.precision == "bf16"}, "zero_allow_untested_optimizer": True}
    if not run.trainer_scheduler:
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                                                              "warmup_num_steps": "auto"}}
    return config


class _Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _gathered(model: Any, engine: Any) -> dict[tuple[str, str], torch.Tensor]:
    """Every parameter's fp32 master and Adam moments, gathered by DeepSpeed's own accessors (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if engine.zero_optimization_stage() < 3:  # ZeRO 1/2 link the accessors to
        engine.optimizer._hp_optimizer_states_linked = False              # Adam's state at the next step only
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in model.named_parameters():
        out[(name, "fp32_master")] = safe_get_full_fp32_param(p).clone()
        out[(name, "exp_avg")] = safe_get_full_optimizer_state(p, "exp_avg").clone()
        out[(name, "exp_avg_sq")] = safe_get_full_optimizer_state(p, "exp_avg_sq").clone()
    return out


# modules a rank imports: the session's fork server imports them once (tests/conftest.py)
PRELOAD = ("transformers.trainer", "transformers.models.llama.modeling_llama", "deepspeed")


def _rank_main(ctx: Any, mode: str, run: TrainerRun, out: str, resume: str | None) -> dict[str, Any] | None:
    """One rank of the Trainer run, in the process group (Gloo) the worker group joined as torchrun's would;
    rank 0's result is what `_launch` returns."""
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    torch.set_num_threads(1)
    rank = ctx.rank
    torch.manual_seed(0)
    config = json.loads(run.config) if run.config else {"model_type": "llama", **CONFIG}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
    if mode == "resume":
        with torch.no_grad():  # other weights than the checkpoint's: the resume must replace every one
            for p in model.parameters():
                p.normal_()
    steps = run.steps + (1 if mode == "resume" else 0)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=steps, save_steps=run.steps,
                             save_strategy="steps", logging_steps=1, learning_rate=1e-2, weight_decay=0.01,
                             warmup_steps=2, use_cpu=True, deepspeed=_ds_config(run), report_to=[], seed=3,
                             bf16=run.precision == "bf16", dataloader_num_workers=0, disable_tqdm=True)
    seen: dict[str, Any] = {}

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if mode == "resume" and not seen:
                engine = trainer.model_wrapped
                # DeepSpeed's (last_batch_iteration) or the Trainer's torch scheduler (last_epoch; accelerate wraps it)
                scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)
                seen.update(state=_gathered(model, engine), global_step=state.global_step,
                            scheduler=getattr(scheduler, "last_batch_iteration", getattr(scheduler, "last_epoch", None)),
                            adam_steps=sorted({float(s["step"]) for s in engine.optimizer.optimizer.state.values()
                                               if "step" in s}))

    trainer = Trainer(model=model, args=args, train_dataset=_Data(), callbacks=[Probe()])
    result = trainer.train(resume_from_checkpoint=resume)
    if mode == "train":
        seen.update(state=_gathered(trainer.model, trainer.model_wrapped), global_step=trainer.state.global_step)
    seen["loss"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    seen["train_loss"] = result.training_loss
    return seen if rank == 0 else None


def _launch(mode: str, run: TrainerRun, world_size: int, out: Path, resume: Path | None = None) -> dict[str, Any]:
    from migrate.runtime.worker_group import WorkerGroupSpec, start_worker_group

    out.mkdir(parents=True, exist_ok=True)
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false"}
    spec = WorkerGroupSpec(world_size=world_size, mode="local", backend="gloo", env=env, timeout_s=600,
                           preload=PRELOAD)
    with start_worker_group(spec) as group:
        return group.run(_rank_main, mode, run, str(out), str(resume) if resume else None)[0]


def save_trainer_checkpoint(run: TrainerRun, out: Path) -> tuple[Path, dict[str, Any]]:
    """Train `run` and save as the Trainer does; (out/checkpoint-N, the state gathered at the save)."""
    reference = _launch("train", run, run.world_size, out)
    return out / f"checkpoint-{run.steps}", reference


def trainer_resume(run: TrainerRun, checkpoint: Path, world_size: int, out: Path) -> dict[str, Any]:
    """`Trainer.train(resume_from_checkpoint=checkpoint)` at `world_size` processes for one more step: what it
    restored (gathered state, global step, scheduler position, Adam steps) and its losses."""
    return _launch("resume", run, world_size, out, checkpoint)


def config_dict() -> dict[str, Any]:
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG).to_dict()

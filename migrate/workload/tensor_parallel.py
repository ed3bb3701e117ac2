"""DTensor tensor parallelism for the built-in torch decoder, torchtitan-style.

`tp_plan(model, sequence_parallel)` is the pure plan handed to
`torch.distributed.tensor.parallel.parallelize_module` on the `tp` axis of a dp x tp mesh:

* per layer: q/k/v_proj and gate/up_proj `ColwiseParallel`, o_proj and down_proj
  `RowwiseParallel` (Megatron's column/row split, one all-reduce per block);
* embed_tokens `RowwiseParallel` (vocab rows split, input replicated), lm_head
  `ColwiseParallel` gathering full logits (`output_layouts=Replicate()`), so the loss is the
  plain cross-entropy of the unsharded model;
* with `sequence_parallel`: the residual stream between blocks is sharded on the sequence dim
  (`Shard(1)`); the three norms are `SequenceParallel`; attention and MLP inputs are
  all-gathered by `PrepareModuleInput`; o_proj/down_proj reduce-scatter back to `Shard(1)`.

The mesh is `init_device_mesh(type, (dp, tp), mesh_dim_names=("dp", "tp"))`: the TP ranks of one
DP replica are consecutive (rank = dp_rank * tp + tp_rank). FSDP2 then shards on the `dp` axis.
Dense models only (the MoE FFN of `torch_model.MoE` is not split); every split dim must divide
by tp because Gloo's all-gather refuses uneven pieces.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from checkpoint.model_shape import ModelShape

MESH_AXES = ("dp", "tp")


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshShape:
    """The dp x tp mesh of a run of `world_size` ranks."""

    dp: int
    tp: int

    @classmethod
    def of(cls, world_size: int, tp: int) -> MeshShape:
        if tp < 1 or world_size % tp:
            raise ValueError(f"world_size({world_size}) is not divisible by tp({tp})")
        return cls(dp=world_size // tp, tp=tp)

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(dp_rank, tp_rank) of a global rank."""
        return divmod(rank, self.tp)


def check_tensor_parallel(model: ModelShape, tp: int, sequence_parallel: bool) -> None:
    """Raise ValueError naming every split that `tp` does not divide (or an MoE model at tp > 1)."""
    if tp == 1:
        return
    if model.is_moe:
        raise ValueError(f"DTensor tp({tp}) covers dense models; architecture {model.architecture!r} "
                         f"(num_experts={model.num_experts}) trains at tp=1 with the fsdp engine (use megatron for EP)")
    if model.tied_embeddings:
        raise ValueError(f"DTensor tp({tp}) with tied_embeddings: embed_tokens (RowwiseParallel) and lm_head "
                         "(ColwiseParallel) would each distribute the one shared weight; train untied at tp > 1")
    sizes = {"num_attention_heads": model.num_attention_heads, "num_query_groups": model.num_query_groups,
             "ffn_hidden_size": model.ffn_hidden_size, "padded vocab": model.padded_vocab_size()}
    if sequence_parallel:
        sizes["seq_length"] = model.seq_length
    bad = [f"{name}({value})" for name, value in sizes.items() if value % tp]
    if bad:
        raise ValueError(f"tp({tp}) does not divide {', '.join(bad)} (Gloo needs even DTensor shards)")


def tp_plan(model: ModelShape, sequence_parallel: bool) -> dict[str, Any]:
    """The `parallelize_module` plan for the whole decoder (fully-qualified module names)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "lm_head": ColwiseParallel(input_layouts=residual, output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for i in range(model.num_layers):
        p = f"layers.{i}"
        plan.update({
            f"{p}.self_attn.q_proj": ColwiseParallel(), f"{p}.self_attn.k_proj": ColwiseParallel(),
            f"{p}.self_attn.v_proj": ColwiseParallel(),
            f"{p}.self_attn.o_proj": RowwiseParallel(output_layouts=residual),
            f"{p}.mlp.up_proj": ColwiseParallel(),
            f"{p}.mlp.down_proj": RowwiseParallel(output_layouts=residual),
        })
        if model.gated_ffn:
            plan[f"{p}.mlp.gate_proj"] = ColwiseParallel()
        if sequence_parallel:
            plan.update({
                f"{p}.input_layernorm": SequenceParallel(),
                f"{p}.post_attention_layernorm": SequenceParallel(),
                f"{p}.self_attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                     desired_input_layouts=(Replicate(), None, None),
                                                     use_local_output=True),
                f"{p}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                               use_local_output=True),
            })
    return plan


def build_mesh(device_type: str, shape: MeshShape) -> Any:
    """The 2-D ("dp", "tp") device mesh over all ranks of the default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (shape.dp, shape.tp), mesh_dim_names=MESH_AXES)


def parallelize(model: Any, tp_mesh: Any, spec: ModelShape, sequence_parallel: bool) -> Any:
    """Apply `tp_plan` on the 1-D `tp_mesh`; returns the module (its params become DTensors)."""
    from torch.distributed.tensor.parallel import parallelize_module

    check_tensor_parallel(spec, tp_mesh.size(), sequence_parallel)
    return parallelize_module(model, tp_mesh, tp_plan(spec, sequence_parallel))

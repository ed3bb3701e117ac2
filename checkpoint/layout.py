"""The parallel layout of a training job: one frozen value shared by every library.

A layout says how a job's ranks are split into tensor (tp), pipeline (pp), virtual
pipeline (vpp), context (cp), expert (ep) and data (dp) parallel groups, how the
optimizer state is sharded, and in which order the axes are laid over ranks.

Vocabulary used across the project: an *axis* is one of the parallel dimensions
(tp, cp, ep, dp, pp); a *dim* is a tensor dimension; a *rank* is a global process
index; *coordinates* are a rank's index along each axis.

Rank order follows Megatron-Core's ``order`` string: the first axis varies fastest.
With the default ``"tp-cp-ep-dp-pp"`` ranks ``0..tp-1`` form the first TP group.
Expert parallelism is carved out of the data-parallel (and context-parallel) ranks,
as Megatron-Core does with ``expert_tensor_parallel_size == tp``: the ``ep`` axis in
``order`` splits the dense ``dp`` axis into ``ep`` x ``dp // ep`` for expert layers,
so ``world_size`` is ``tp * cp * dp * pp`` and ``ep`` must divide ``dp * cp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from collections.abc import Mapping

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
# decoder layers on the first / last pipeline rank (None: an even split)
PIPELINE_STAGE_FIELDS = ("first_pipeline_stage_layers", "last_pipeline_stage_layers")


class LayoutError(ValueError):
    """A parallel layout whose numbers do not fit together; the message prints all of them."""


class OptimizerSharding(str, Enum):
    """How optimizer state (fp32 master, Adam moments) is split over data-parallel ranks."""

    NONE = "none"  # every DP rank holds the full state (plain DDP)
    ZERO1 = "zero1"  # DeepSpeed ZeRO stage 1: optimizer state partitioned
    ZERO2 = "zero2"  # ZeRO 2: optimizer state and gradients partitioned
    ZERO3 = "zero3"  # ZeRO 3: parameters partitioned as well
    DISTRIBUTED_OPTIMIZER = "distributed_optimizer"  # Megatron-Core DistributedOptimizer
    FSDP = "fsdp"  # PyTorch FSDP2: parameters and state sharded per parameter

    @property
    def zero_stage(self) -> int:
        """The DeepSpeed ZeRO stage this sharding corresponds to (0 when none)."""
        return {"zero1": 1, "zero2": 2, "zero3": 3}.get(self.value, 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankCoordinates:
    """A rank's index along every axis; ``ep`` and ``expert_dp`` apply to expert layers."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    expert_dp: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    """How a job's ranks are split; validated on construction.

    ``vpp`` is the number of virtual pipeline stages per pipeline rank (1 = none). ``first_pipeline_stage_layers`` /
    ``last_pipeline_stage_layers`` put that many decoder layers on the first / last pipeline rank and split the rest
    evenly over the middle ranks (Megatron-LM's --decoder-first/last-pipeline-num-layers; None: an even split).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    vpp: int = 1
    sharding: OptimizerSharding = OptimizerSharding.NONE
    order: str = DEFAULT_ORDER
    first_pipeline_stage_layers: int | None = None
    last_pipeline_stage_layers: int | None = None

    def __post_init__(self) -> None:
        sizes = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep, "cp": self.cp, "vpp": self.vpp}
        sizes |= {k: v for k, v in self.pipeline_split.items() if v is not None}
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
        if bad:
            raise LayoutError(f"parallel sizes must be integers >= 1, got {bad} in {self}")
        if self.pp == 1 and self.uneven:
            raise LayoutError(f"first/last pipeline stage layers {self.pipeline_split} need pp > 1, got pp(1)")
        axes = self.order.split("-")
        if sorted(axes) != sorted(AXES):
            raise LayoutError(f"order {self.order!r} must name each of {', '.join(AXES)} exactly once")
        if (self.dp * self.cp) % self.ep:
            raise LayoutError(
                f"ep({self.ep}) must divide dp({self.dp}) * cp({self.cp}) = {self.dp * self.cp}: "
                "expert parallel ranks are carved out of the data/context parallel ranks"
            )
        if not isinstance(self.sharding, OptimizerSharding):
            object.__setattr__(self, "sharding", OptimizerSharding(self.sharding))
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(f"vpp({self.vpp}) > 1 needs pp > 1, got pp({self.pp})")

    @property
    def pipeline_split(self) -> dict[str, int | None]:
        """The first/last pipeline stage layer counts by field name (None: even)."""
        return {k: getattr(self, k) for k in PIPELINE_STAGE_FIELDS}

    @property
    def uneven(self) -> bool:
        """Whether the first or last pipeline rank has its own layer count."""
        return self.first_pipeline_stage_layers is not None or self.last_pipeline_stage_layers is not None

    @property
    def world_size(self) -> int:
        """tp * cp * dp * pp (ep lives inside dp * cp)."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def zero_stage(self) -> int:
        """DeepSpeed ZeRO stage (0 when the sharding is not ZeRO)."""
        return self.sharding.zero_stage

    @property
    def distributed_optimizer(self) -> bool:
        """True for Megatron-Core's DistributedOptimizer sharding."""
        return self.sharding is OptimizerSharding.DISTRIBUTED_OPTIMIZER

    def check_world_size(self, world_size: int, *, what: str = "world_size") -> None:
        """Raise LayoutError unless the layout covers exactly ``world_size`` ranks."""
        if self.world_size != world_size:
            raise LayoutError(
                f"tp({self.tp}) * cp({self.cp}) * dp({self.dp}) * pp({self.pp}) = {self.world_size} "
                f"!= {what}({world_size})"
            )

    def _dense_sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def coordinates(self, rank: int) -> RankCoordinates:
        """The coordinates of ``rank`` under ``order`` (first axis fastest)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside 0..{self.world_size - 1} for {self}")
        sizes = self._dense_sizes()
        coords: dict[str, int] = {}
        rest = rank
        for axis in self.order.split("-"):
            if axis == "ep":
                continue
            coords[axis] = rest % sizes[axis]
            rest //= sizes[axis]
        # Expert layers: the dp*cp ranks of one (tp, pp) slice split into ep x expert_dp,
        # ep varying fastest, as in Megatron-Core's expert rank generator.
        dense_dp_index = coords["cp"] + self.cp * coords["dp"]
        return RankCoordinates(
            rank=rank,
            tp=coords["tp"],
            cp=coords["cp"],
            dp=coords["dp"],
            pp=coords["pp"],
            ep=dense_dp_index % self.ep,
            expert_dp=dense_dp_index // self.ep,
        )

    def rank_of(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at the given dense coordinates (inverse of ``coordinates``)."""
        sizes = self._dense_sizes()
        given = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        for axis, value in given.items():
            if not 0 <= value < sizes[axis]:
                raise LayoutError(f"{axis} index {value} outside 0..{sizes[axis] - 1} for {self}")
        rank, stride = 0, 1
        for axis in self.order.split("-"):
            if axis == "ep":
                continue
            rank += given[axis] * stride
            stride *= sizes[axis]
        return rank

    def describe(self) -> str:
        """A short human label such as ``tp2·pp2·dp4·ep2 zero1``."""
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.first_pipeline_stage_layers is not None:
            parts.append(f"first{self.first_pipeline_stage_layers}")
        if self.last_pipeline_stage_layers is not None:
            parts.append(f"last{self.last_pipeline_stage_layers}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        parts.append(f"dp{self.dp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        label = "·".join(parts)
        return label if self.sharding is OptimizerSharding.NONE else f"{label} {self.sharding.value}"

    def to_dict(self) -> dict[str, object]:
        """Every field as plain values; the stage layer counts only when set."""
        out: dict[str, object] = {
            "tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep, "cp": self.cp,
            "vpp": self.vpp, "sharding": self.sharding.value, "order": self.order,
        }
        return out | {k: v for k, v in self.pipeline_split.items() if v is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> ParallelLayout:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise LayoutError(f"unknown layout keys {unknown}; allowed: {sorted(known)}")
        return cls(**data)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutRequest:
    """A layout asked of a conversion, axis by axis; a `None` axis is left to the checkpoint.

    As a conversion's `target`: the layout to write (`None`: the source's size, or the target format's only
    choice). As its `expect`: what the source must declare (`None`: not checked; `vpp` and the stage layer
    counts are not declared by every source and cannot be expected). `dp` is the data-parallel size (for DCP:
    the world size), `zero_stage` DeepSpeed's ZeRO stage (1-3); `first_pipeline_stage_layers` / `last_pipeline_stage_layers` the
    decoder layers of the first / last pipeline rank (None: the source's when the pipeline is kept, else even)."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    vpp: int | None = None
    zero_stage: int | None = None
    first_pipeline_stage_layers: int | None = None
    last_pipeline_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for axis in ("dp", "tp", "pp", "ep", "vpp", *PIPELINE_STAGE_FIELDS):
            value = getattr(self, axis)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise LayoutError(f"{axis}={value!r}: a parallel size is a positive integer (or None: the checkpoint's)")
        if self.zero_stage is not None and self.zero_stage not in (1, 2, 3):
            raise LayoutError(f"zero_stage={self.zero_stage!r}: DeepSpeed's ZeRO stages are 1, 2 and 3 (or None)")

    def describe(self) -> str:
        """The axes asked for, e.g. ``tp2·dp4 zero1``; ``as the checkpoint`` when none is."""
        parts = [f"{axis}{getattr(self, axis)}" for axis in ("tp", "pp", "vpp", "dp", "ep") if getattr(self, axis)]
        parts += [f"{end}{n}" for end, n in (("first", self.first_pipeline_stage_layers),
                                             ("last", self.last_pipeline_stage_layers)) if n is not None]
        label = "·".join(parts)
        if self.zero_stage is not None:
            label = f"{label} zero{self.zero_stage}".strip()
        return label or "as the checkpoint"

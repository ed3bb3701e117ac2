"""The candidate space: every (framework, tp, cp, pp, vpp, dp, ep, micro batch, recompute,
sequence parallel, optimizer sharding) for a model on a cluster, valid or not.

Validity follows the frameworks' own divisibility rules (Megatron-LM's argument checks,
DeepSpeed's batch rule); an invalid candidate keeps every reason it fails. Pure functions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import Literal
from collections.abc import Iterator

from checkpoint.layout import OptimizerSharding, ParallelLayout
from checkpoint.model_shape import ModelShape
from parallel_search.spec import ClusterShape, SpecError, TrainingShape

Framework = Literal["megatron", "deepspeed"]
Recompute = Literal["none", "selective", "full"]
FRAMEWORK_SHARDINGS: dict[str, tuple[OptimizerSharding, ...]] = {
    "megatron": (OptimizerSharding.NONE, OptimizerSharding.DISTRIBUTED_OPTIMIZER),
    "deepspeed": (OptimizerSharding.NONE, OptimizerSharding.ZERO1, OptimizerSharding.ZERO2, OptimizerSharding.ZERO3),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One parallel plan: a layout plus the per-step knobs that change speed and memory."""

    framework: Framework
    layout: ParallelLayout
    micro_batch_size: int
    recompute: Recompute = "none"
    sequence_parallel: bool = False

    @property
    def key(self) -> str:
        """Stable identity used by the cache and the tables, e.g. ``megatron:tp2.pp1.vpp1.cp1.dp2.ep1.mbs2.rc-none.sp0.none``."""
        lay = self.layout
        return (f"{self.framework}:tp{lay.tp}.pp{lay.pp}.vpp{lay.vpp}.cp{lay.cp}.dp{lay.dp}.ep{lay.ep}"
                f".mbs{self.micro_batch_size}.rc-{self.recompute}.sp{int(self.sequence_parallel)}.{lay.sharding.value}")

    def label(self) -> str:
        extra = [f"mbs{self.micro_batch_size}"]
        if self.sequence_parallel:
            extra.append("sp")
        if self.recompute != "none":
            extra.append(f"rc-{self.recompute}")
        return f"{self.framework} {self.layout.describe()} {' '.join(extra)}"

    def num_microbatches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.micro_batch_size * self.layout.dp)

    def to_dict(self) -> dict[str, object]:
        return {"framework": self.framework, "layout": self.layout.to_dict(), "micro_batch_size": self.micro_batch_size,
                "recompute": self.recompute, "sequence_parallel": self.sequence_parallel}

    @classmethod
    def from_dict(cls, data: dict) -> Candidate:
        return cls(framework=data["framework"], layout=ParallelLayout.from_dict(data["layout"]),
                   micro_batch_size=int(data["micro_batch_size"]), recompute=data["recompute"],
                   sequence_parallel=bool(data["sequence_parallel"]))


@dataclass(frozen=True, kw_only=True, slots=True)
class SpaceOptions:
    """Which knobs the search may turn. ``micro_batch_sizes`` None: powers of two up to ``max_micro_batch``;
    ``sequence_parallel`` "auto": on exactly when tp > 1 (Megatron's recommendation)."""

    frameworks: tuple[Framework, ...] = ("megatron", "deepspeed")
    micro_batch_sizes: tuple[int, ...] | None = None
    max_micro_batch: int = 8
    recompute: tuple[Recompute, ...] = ("none", "selective", "full")
    sequence_parallel: Literal["auto", "both", "off"] = "auto"
    vpp: tuple[int, ...] = (1, 2, 4)
    context_parallel: tuple[int, ...] = (1, 2, 4, 8)
    max_tp: int | None = None  # None: devices_per_node (TP stays inside a node)
    shardings: tuple[OptimizerSharding, ...] | None = None  # None: every sharding the framework has

    def __post_init__(self) -> None:
        unknown = sorted(set(self.frameworks) - set(FRAMEWORK_SHARDINGS))
        if unknown or not self.frameworks:
            raise ValueError(f"space.frameworks {list(self.frameworks)}: expected a non-empty subset of "
                             f"{sorted(FRAMEWORK_SHARDINGS)}")
        bad = [r for r in self.recompute if r not in ("none", "selective", "full")]
        if bad or not self.recompute:
            raise ValueError(f"space.recompute {list(self.recompute)}: expected a subset of none, selective, full")
        if self.sequence_parallel not in ("auto", "both", "off"):
            raise ValueError(f"space.sequence_parallel={self.sequence_parallel!r}: expected auto, both or off")
        if self.micro_batch_sizes is not None and (not self.micro_batch_sizes or min(self.micro_batch_sizes) < 1):
            raise ValueError(f"space.micro_batch_sizes {self.micro_batch_sizes} must be integers >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class Rejected:
    """A candidate that breaks a rule, with every reason."""

    candidate: Candidate
    reasons: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Space:
    """The enumerated space: valid candidates in a stable order and rejected ones with reasons."""

    valid: tuple[Candidate, ...]
    rejected: tuple[Rejected, ...] = field(default=())

    @property
    def size(self) -> int:
        return len(self.valid) + len(self.rejected)

    def reason_counts(self) -> dict[str, int]:
        """How many rejected candidates each rule removed (the rule is the reason up to its first ':')."""
        counts: dict[str, int] = {}
        for item in self.rejected:
            for reason in item.reasons:
                rule = reason.split(":")[0]
                counts[rule] = counts.get(rule, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorizations(world: int, cps: tuple[int, ...]) -> Iterator[tuple[int, int, int, int]]:
    """(tp, cp, pp, dp) with tp * cp * pp * dp == world."""
    for tp in divisors(world):
        for cp in divisors(world // tp):
            if cp not in cps:
                continue
            for pp in divisors(world // (tp * cp)):
                yield tp, cp, pp, world // (tp * cp * pp)


def candidate_problems(model: ModelShape, train: TrainingShape, cluster: ClusterShape, cand: Candidate,
                       max_tp: int | None = None) -> list[str]:
    """Every rule ``cand`` breaks for this model, batch and cluster (empty: valid). Pure."""
    lay, p = cand.layout, []
    if lay.world_size != cluster.device_count:
        p.append(f"world size: tp({lay.tp}) * cp({lay.cp}) * dp({lay.dp}) * pp({lay.pp}) = {lay.world_size} "
                 f"!= device_count({cluster.device_count})")
    limit = max_tp or cluster.per_node
    if lay.tp > limit:
        p.append(f"tp across nodes: tp({lay.tp}) > devices per node ({limit})")
    for name, value in (("num_attention_heads", model.num_attention_heads),
                        ("num_query_groups", model.num_query_groups), ("ffn_hidden_size", model.ffn_hidden_size)):
        if value % lay.tp:
            p.append(f"tp divides {name}: tp({lay.tp}) does not divide {name}({value})")
    stages = lay.pp * lay.vpp
    if model.num_layers % stages:
        p.append(f"layers per stage: pp({lay.pp}) * vpp({lay.vpp}) = {stages} does not divide "
                 f"num_layers({model.num_layers})")
    per_step = cand.micro_batch_size * lay.dp
    if train.global_batch_size % per_step:
        p.append(f"batch: global_batch_size({train.global_batch_size}) is not a multiple of "
                 f"micro_batch_size({cand.micro_batch_size}) * dp({lay.dp}) = {per_step}")
    elif lay.vpp > 1 and cand.num_microbatches(train.global_batch_size) % lay.pp:
        m = cand.num_microbatches(train.global_batch_size)
        p.append(f"interleaved schedule: micro-batches({m}) is not a multiple of pp({lay.pp})")
    if lay.ep > 1 and not model.is_moe:
        p.append(f"ep needs MoE: ep({lay.ep}) > 1 but num_experts is {model.num_experts}")
    if model.is_moe and model.num_experts % lay.ep:
        p.append(f"ep divides experts: ep({lay.ep}) does not divide num_experts({model.num_experts})")
    if lay.cp > 1 and model.seq_length % (2 * lay.cp):
        p.append(f"cp divides sequence: 2 * cp({lay.cp}) does not divide seq_length({model.seq_length})")
    if cand.sequence_parallel and lay.tp == 1:
        p.append("sequence parallel needs tp: sequence_parallel with tp(1)")
    if lay.sharding not in FRAMEWORK_SHARDINGS[cand.framework]:
        p.append(f"sharding: {cand.framework} has no {lay.sharding.value} optimizer sharding")
    if lay.sharding is not OptimizerSharding.NONE and lay.dp == 1 and lay.ep == 1:
        p.append(f"sharding over one rank: {lay.sharding.value} with dp(1) shards nothing (same as none)")
    if cand.framework == "deepspeed":
        split = {k: v for k, v in (("tp", lay.tp), ("pp", lay.pp), ("cp", lay.cp), ("ep", lay.ep)) if v > 1}
        if split or cand.sequence_parallel:
            p.append(f"deepspeed is data parallel: DeepSpeed's engine alone has no tensor/pipeline/context/expert "
                     f"split, got {split or {'sequence_parallel': True}} (use Megatron for those)")
        if cand.recompute == "selective":
            p.append("deepspeed recompute: DeepSpeed checkpoints whole layers only (recompute full or none)")
    return p


def enumerate_space(model: ModelShape, train: TrainingShape, cluster: ClusterShape,
                    options: SpaceOptions = SpaceOptions()) -> Space:
    """All candidates for ``cluster.device_count`` devices, split into valid and rejected. Pure.

    Candidates that cannot even form a layout (e.g. ep not dividing dp * cp) are rejected
    with the layout's own message.
    """
    if model.seq_length < 1:
        raise SpecError(f"model.seq_length={model.seq_length}: the search needs the tokens per sample (>= 1)")
    world = cluster.device_count
    valid: list[Candidate] = []
    rejected: list[Rejected] = []
    sp_choices = {"auto": None, "both": (False, True), "off": (False,)}[options.sequence_parallel]
    for framework in options.frameworks:
        for (tp, cp, pp, dp), vpp in product(_factorizations(world, options.context_parallel), options.vpp):
            if vpp > 1 and pp == 1:
                continue  # no virtual stages without a pipeline: not a distinct plan
            experts = divisors(model.num_experts) if model.is_moe else [1]
            for ep in experts:
                if (dp * cp) % ep:
                    continue  # expert ranks are carved out of dp * cp; not a layout at all
                for sharding in FRAMEWORK_SHARDINGS[framework]:
                    if options.shardings is not None and sharding not in options.shardings:
                        continue
                    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, vpp=vpp, sharding=sharding)
                    per_rank = train.global_batch_size // dp if train.global_batch_size % dp == 0 else 0
                    mbss = options.micro_batch_sizes or tuple(
                        b for b in (1, 2, 4, 8, 16, 32, 64) if b <= options.max_micro_batch and (per_rank == 0 or b <= per_rank))
                    for mbs, recompute in product(mbss, options.recompute):
                        for sp in (sp_choices or ((tp > 1),)):
                            cand = Candidate(framework=framework, layout=layout, micro_batch_size=mbs,
                                             recompute=recompute, sequence_parallel=sp)
                            problems = candidate_problems(model, train, cluster, cand, options.max_tp)
                            if problems:
                                rejected.append(Rejected(candidate=cand, reasons=tuple(problems)))
                            else:
                                valid.append(cand)
    return Space(valid=tuple(valid), rejected=tuple(rejected))


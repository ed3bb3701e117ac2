"""The YAML job schema: one frozen pydantic model per section, unknown keys are errors.

A job says where the source run is (checkpoint, layout, metrics, cluster), where it
goes (Ray address, device type and count, backend, optional layout), what is trained
(model, training), which stages run with which options, and how progress is tracked.
Cross-field rules (layout sizes against the device count, heads against TP, ...) are
checked here so that ``migrate validate`` reports every problem before anything runs.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, field_validator, model_validator

from checkpoint.layout import AXES, LayoutError, OptimizerSharding, ParallelLayout
from migrate.runtime.backend import DEVICE_TYPES, BackendError, resolve_backend
from migrate.runtime.ray_cluster import validate_address

DeviceType = Literal["cpu", "cuda", "npu", "xpu"]
assert set(DeviceType.__args__) == set(DEVICE_TYPES)  # type: ignore[attr-defined]


class Section(BaseModel):
    """Base of every job section: frozen, unknown keys rejected, no silent coercion of bools."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class LayoutSection(Section):
    """A parallel layout (see ``checkpoint.layout.ParallelLayout``)."""

    tp: PositiveInt = 1
    pp: PositiveInt = 1
    dp: PositiveInt = 1
    ep: PositiveInt = 1
    cp: PositiveInt = 1
    vpp: PositiveInt = 1
    sharding: OptimizerSharding = OptimizerSharding.NONE
    order: str = "tp-cp-ep-dp-pp"

    @model_validator(mode="after")
    def _valid_layout(self) -> "LayoutSection":
        try:
            self.to_layout()
        except LayoutError as exc:
            raise ValueError(str(exc)) from None
        return self

    def to_layout(self) -> ParallelLayout:
        return ParallelLayout(**self.model_dump())


class CheckpointSection(Section):
    """A checkpoint on disk and its format."""

    path: str
    format: Literal["deepspeed", "deepspeed-universal", "megatron", "megatron-legacy", "dcp", "hf", "auto"] = "auto"
    step: int | None = Field(default=None, ge=0, description="which saved step; None: the latest")

    @field_validator("format", mode="before")
    @classmethod
    def _current_spelling(cls, value: Any) -> Any:
        from checkpoint.formats import FORMAT_ALIASES

        return FORMAT_ALIASES.get(value, value)  # the earlier spelling is noted by `deprecations`


class MetricsSection(Section):
    """A metric series of a run (loss, grad norm, ...) and how to read it."""

    path: str
    format: Literal["auto", "jsonl", "csv", "tensorboard", "wandb", "megatron_log", "deepspeed_log"] = "auto"
    label: str | None = None


class ClusterSection(Section):
    """The accelerators a run uses: type, count, per node, collective backend."""

    device_type: DeviceType
    device_count: PositiveInt
    devices_per_node: PositiveInt | None = None
    backend: str = "auto"

    @model_validator(mode="after")
    def _consistent(self) -> "ClusterSection":
        per_node = self.devices_per_node or self.device_count
        if self.device_count % per_node:
            raise ValueError(f"device_count({self.device_count}) is not a multiple of devices_per_node({per_node})")
        try:
            resolve_backend(self.device_type, self.backend)
        except BackendError as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def resolved_backend(self) -> str:
        return resolve_backend(self.device_type, self.backend)


class SourceSection(Section):
    """The run being moved: its checkpoint, layout, metrics and cluster."""

    checkpoint: CheckpointSection | None = None
    layout: LayoutSection
    metrics: tuple[MetricsSection, ...] = ()
    cluster: ClusterSection

    @model_validator(mode="after")
    def _layout_fits_cluster(self) -> "SourceSection":
        layout = self.layout.to_layout()
        if layout.world_size != self.cluster.device_count:
            raise ValueError(
                f"layout tp({layout.tp}) * cp({layout.cp}) * dp({layout.dp}) * pp({layout.pp}) = {layout.world_size} "
                f"!= cluster.device_count({self.cluster.device_count})"
            )
        return self


class RaySection(Section):
    """Where Ray runs: an embedded local cluster, or an existing one."""

    address: str = "embedded"
    num_cpus: PositiveInt | None = Field(default=None, description="logical CPUs of an embedded cluster")

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return validate_address(value)


class TargetSection(ClusterSection):
    """The cluster the run moves to; ``layout`` may be left to the search stage."""

    ray: RaySection = RaySection()
    device_profile: str | None = None
    layout: LayoutSection | None = None
    micro_batch_size: PositiveInt | None = Field(
        default=None, description="the target run's micro batch; default: training.micro_batch_size (the global "
                                  "batch is kept, gradient accumulation follows)")
    timeout_s: PositiveFloat = Field(default=300.0, description="limit for one call on the worker group")

    @model_validator(mode="after")
    def _layout_fits(self) -> "TargetSection":
        if self.layout is not None:
            layout = self.layout.to_layout()
            if layout.world_size != self.device_count:
                raise ValueError(
                    f"layout tp({layout.tp}) * cp({layout.cp}) * dp({layout.dp}) * pp({layout.pp}) = {layout.world_size} "
                    f"!= device_count({self.device_count})"
                )
        return self


class ModelSection(Section):
    """The model architecture (GPT/Llama decoder, or Mixtral-style MoE)."""

    architecture: Literal["gpt", "llama", "mixtral"]
    num_layers: PositiveInt
    hidden_size: PositiveInt
    ffn_hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    num_query_groups: PositiveInt | None = None  # None: multi-head attention (= heads)
    vocab_size: PositiveInt
    seq_length: PositiveInt
    tied_embeddings: bool = False
    num_experts: int = Field(default=0, ge=0)
    moe_top_k: PositiveInt = 2
    make_vocab_size_divisible_by: PositiveInt = 128
    rotary_base: PositiveFloat = 10000.0
    norm_eps: PositiveFloat = 1e-5

    @model_validator(mode="after")
    def _shapes(self) -> "ModelSection":
        heads, groups = self.num_attention_heads, self.query_groups
        if self.hidden_size % heads:
            raise ValueError(f"hidden_size({self.hidden_size}) is not divisible by num_attention_heads({heads})")
        if heads % groups:
            raise ValueError(f"num_attention_heads({heads}) is not divisible by num_query_groups({groups})")
        if self.architecture == "mixtral":
            if self.num_experts < 2:
                raise ValueError(f"architecture 'mixtral' needs num_experts >= 2, got {self.num_experts}")
            if self.moe_top_k > self.num_experts:
                raise ValueError(f"moe_top_k({self.moe_top_k}) > num_experts({self.num_experts})")
        elif self.num_experts > 1:
            raise ValueError(f"num_experts({self.num_experts}) needs architecture 'mixtral', got {self.architecture!r}")
        return self

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def check_layout(self, layout: ParallelLayout, where: str) -> list[str]:
        """Problems that stop this model from being split by ``layout`` (empty: it fits)."""
        problems = []
        if self.num_attention_heads % layout.tp:
            problems.append(f"{where}: tp({layout.tp}) does not divide model.num_attention_heads({self.num_attention_heads})")
        if self.query_groups % layout.tp:
            problems.append(f"{where}: tp({layout.tp}) does not divide model.num_query_groups({self.query_groups})")
        if self.ffn_hidden_size % layout.tp:
            problems.append(f"{where}: tp({layout.tp}) does not divide model.ffn_hidden_size({self.ffn_hidden_size})")
        stages = layout.pp * layout.vpp
        if self.num_layers % stages:
            problems.append(f"{where}: pp({layout.pp}) * vpp({layout.vpp}) = {stages} does not divide model.num_layers({self.num_layers})")
        if layout.ep > 1 and self.num_experts == 0:
            problems.append(f"{where}: ep({layout.ep}) > 1 needs a MoE model, model.num_experts is 0")
        if self.num_experts and self.num_experts % layout.ep:
            problems.append(f"{where}: ep({layout.ep}) does not divide model.num_experts({self.num_experts})")
        if layout.cp > 1 and self.seq_length % (2 * layout.cp):
            problems.append(f"{where}: 2 * cp({layout.cp}) does not divide model.seq_length({self.seq_length})")
        return problems


class OptimizerSection(Section):
    name: Literal["adam", "adamw"] = "adamw"
    lr: PositiveFloat = 3e-4
    min_lr: float = Field(default=0.0, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: PositiveFloat = 1e-8
    grad_clip: float = Field(default=1.0, ge=0, description="0 disables clipping")


class ScheduleSection(Section):
    warmup_steps: int = Field(default=0, ge=0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    decay_steps: PositiveInt | None = None  # None: train_steps


class TrainingSection(Section):
    """The training recipe shared by baseline and target runs."""

    global_batch_size: PositiveInt
    micro_batch_size: PositiveInt = 1
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    optimizer: OptimizerSection = OptimizerSection()
    lr_schedule: ScheduleSection = ScheduleSection()
    seed: int = Field(default=1234, ge=0)
    train_steps: PositiveInt = 100

    def check_layout(self, layout: ParallelLayout, where: str, micro_batch_size: int | None = None) -> list[str]:
        micro = micro_batch_size or self.micro_batch_size
        per_step = micro * layout.dp
        if self.global_batch_size % per_step:
            return [
                f"{where}: training.global_batch_size({self.global_batch_size}) is not a multiple of "
                f"micro_batch_size({micro}) * dp({layout.dp}) = {per_step}"
            ]
        return []


class WandbSection(Section):
    enabled: bool = False
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "migrate"
    entity: str | None = None
    group: str | None = None


class TrackingSection(Section):
    """Where progress goes: JSONL always; TensorBoard and W&B when enabled."""

    tensorboard: bool = False
    wandb: WandbSection = WandbSection()


class JobSpec(Section):
    """A whole migration job, as written in YAML."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    description: str = ""
    work_dir: str = Field(default="runs/{name}", description="relative paths are relative to the job file")
    source: SourceSection
    target: TargetSection
    model: ModelSection
    training: TrainingSection
    stages: dict[str, dict[str, Any] | None] = Field(default_factory=dict)
    tracking: TrackingSection = TrackingSection()

    @model_validator(mode="after")
    def _cross_checks(self) -> "JobSpec":
        problems: list[str] = []
        layouts = [("source.layout", self.source.layout.to_layout(), None)]
        if self.target.layout is not None:
            layouts.append(("target.layout", self.target.layout.to_layout(), self.target.micro_batch_size))
        for where, layout, micro in layouts:
            problems += self.model.check_layout(layout, where)
            problems += self.training.check_layout(layout, where, micro)
        if problems:
            raise ValueError("; ".join(problems))
        return self


LAYOUT_AXES = AXES

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
from checkpoint.model_shape import Architecture, ModelShape
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
    """tensor-parallel size: each layer's matrices split over this many ranks"""
    pp: PositiveInt = 1
    """pipeline-parallel size: the layers split into this many stages"""
    dp: PositiveInt = 1
    """data-parallel size: model replicas (each a tp x pp x cp group of ranks)"""
    ep: PositiveInt = 1
    """expert-parallel size (MoE): the experts split over this many ranks, carved out of dp x cp"""
    cp: PositiveInt = 1
    """context-parallel size: each sequence split over this many ranks"""
    vpp: PositiveInt = 1
    """virtual pipeline stages per pipeline rank (interleaved schedule; 1: none; needs pp > 1)"""
    sharding: OptimizerSharding = OptimizerSharding.NONE
    """how optimizer state is sharded over dp: none, DeepSpeed ZeRO 1/2/3, Megatron's distributed optimizer, or FSDP"""
    order: str = "tp-cp-ep-dp-pp"
    """the rank order of the axes, fastest first (Megatron-Core's default: tp-cp-ep-dp-pp)"""

    @model_validator(mode="after")
    def _valid_layout(self) -> LayoutSection:
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
    """the checkpoint folder, or the save directory that holds it (DeepSpeed's `latest`, Megatron-LM's
    latest_checkpointed_iteration.txt)"""
    format: Literal["deepspeed", "deepspeed-universal", "megatron", "megatron-legacy", "dcp", "hf", "auto"] = "auto"
    """what wrote it; auto: detected from the files (a stated format must match them)"""
    step: int | None = Field(default=None, ge=0, description="which saved step; None: the latest")

    @field_validator("format", mode="before")
    @classmethod
    def _current_spelling(cls, value: Any) -> Any:
        from checkpoint.formats import FORMAT_ALIASES

        return FORMAT_ALIASES.get(value, value)  # the earlier spelling is noted by `deprecations`


class MetricsSection(Section):
    """A metric series of a run (loss, grad norm, ...) and how to read it."""

    path: str
    """a metrics file or folder of the source run (loss, grad norm, learning rate per step)"""
    format: Literal["auto", "jsonl", "csv", "tensorboard", "wandb", "megatron_log", "deepspeed_log"] = "auto"
    """how to read it: our JSONL, a CSV, TensorBoard events, a W&B run folder, or a Megatron-LM / DeepSpeed training
    log; auto: from its name and content"""
    label: str | None = None
    """the run's name in the gate's report (default: the file's name)"""


class ClusterSection(Section):
    """The accelerators a run uses: type, count, per node, collective backend."""

    device_type: DeviceType
    """the accelerator: cpu, cuda (NVIDIA, AMD ROCm), npu (Ascend, torch_npu) or xpu"""
    device_count: PositiveInt
    """devices in all (one rank each)"""
    devices_per_node: PositiveInt | None = None
    """devices on one node (default: all on one node); device_count must be a multiple"""
    backend: str = "auto"
    """the torch.distributed backend (gloo, nccl, hccl, xccl, mpi, or per device as cpu:gloo,cuda:nccl); auto: the
    device's default (gloo for cpu, nccl for cuda, hccl for npu, xccl for xpu)"""

    @model_validator(mode="after")
    def _consistent(self) -> ClusterSection:
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
    def _layout_fits_cluster(self) -> SourceSection:
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
    """embedded (a Ray cluster started for the job on this machine), auto (the cluster this machine belongs to, as
    under `ray job submit`), or ray://host:port"""
    num_cpus: PositiveInt | None = Field(default=None, description="logical CPUs of an embedded cluster")

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return validate_address(value)


class TargetSection(ClusterSection):
    """The cluster the run moves to; ``layout`` may be left to the search stage."""

    ray: RaySection = RaySection()
    device_profile: str | None = None
    """the device's speeds and memory for the search's cost model: a shipped profile (a100, h100, h200, mi300x,
    ascend-910b, cpu) or a YAML file; default: by device type"""
    layout: LayoutSection | None = None
    micro_batch_size: PositiveInt | None = Field(
        default=None, description="the target run's micro batch; default: training.micro_batch_size (the global "
                                  "batch is kept, gradient accumulation follows)")
    timeout_s: PositiveFloat = Field(default=300.0, description="limit for one call on the worker group")

    @model_validator(mode="after")
    def _layout_fits(self) -> TargetSection:
        if self.layout is not None:
            layout = self.layout.to_layout()
            if layout.world_size != self.device_count:
                raise ValueError(
                    f"layout tp({layout.tp}) * cp({layout.cp}) * dp({layout.dp}) * pp({layout.pp}) = {layout.world_size} "
                    f"!= device_count({self.device_count})"
                )
        return self


class ModelSection(Section):
    """The model architecture (GPT/Llama decoder, or Mixtral-style MoE): ``checkpoint.model_shape.ModelShape``
    with the job's defaults (vocab padded to 128 * tp as Megatron-LM does) and a documented field each."""

    architecture: Architecture
    """gpt (LayerNorm, GeLU), llama (RMSNorm, SwiGLU, RoPE, grouped-query attention), mixtral (llama with MoE
    feed-forward layers), qwen2 (llama with q/k/v biases), qwen3 (llama with per-head q/k RMSNorm), qwen3_moe
    (qwen3 with MoE feed-forward layers) or deepseek_v3 (multi-latent attention, first-k dense layers, routed and
    shared experts, a router expert bias; trained by the megatron engine only)"""
    num_layers: PositiveInt
    """transformer layers"""
    hidden_size: PositiveInt
    """the model width"""
    ffn_hidden_size: PositiveInt
    """the feed-forward (or each expert's) inner width"""
    num_attention_heads: PositiveInt
    """query heads"""
    num_query_groups: PositiveInt | None = None  # None: multi-head attention (= heads)
    """key/value heads (grouped-query attention); default: one per query head"""
    vocab_size: PositiveInt
    """the tokenizer's vocabulary (before padding)"""
    seq_length: PositiveInt
    """tokens per sample"""
    tied_embeddings: bool = False
    """the output layer shares the input embedding's weight"""
    num_experts: int = Field(default=0, ge=0)
    """experts per MoE layer (0: dense)"""
    moe_ffn_hidden_size: int = Field(default=0, ge=0)
    """each expert's inner width (Megatron-LM's --moe-ffn-hidden-size); 0: ffn_hidden_size"""
    moe_top_k: PositiveInt = 2
    """experts each token is routed to"""
    make_vocab_size_divisible_by: PositiveInt = 128
    """the embedding is padded to a multiple of this times tp (Megatron-LM's --make-vocab-size-divisible-by)"""
    rotary_base: PositiveFloat = 10000.0
    """RoPE's base (Megatron-LM's --rotary-base)"""
    norm_eps: PositiveFloat = 1e-5
    """the normalization layers' epsilon"""
    q_lora_rank: int = Field(default=0, ge=0)
    """deepseek_v3: the queries' low-rank width (Megatron-LM's --q-lora-rank); 0: one full q projection"""
    kv_lora_rank: int = Field(default=0, ge=0)
    """deepseek_v3: the keys' and values' low-rank width (--kv-lora-rank)"""
    qk_head_dim: int = Field(default=0, ge=0)
    """deepseek_v3: a head's q/k width without its rotary part (--qk-head-dim)"""
    qk_pos_emb_head_dim: int = Field(default=0, ge=0)
    """deepseek_v3: a head's rotary q/k width (--qk-pos-emb-head-dim)"""
    v_head_dim: int = Field(default=0, ge=0)
    """deepseek_v3: a head's value width (--v-head-dim)"""
    first_k_dense: int = Field(default=0, ge=0)
    """deepseek_v3: the leading layers with a dense feed-forward (HF's first_k_dense_replace)"""
    shared_expert_ffn_hidden_size: int = Field(default=0, ge=0)
    """deepseek_v3: the shared experts' width (--moe-shared-expert-intermediate-size); 0: none"""

    @model_validator(mode="after")
    def _shapes(self) -> ModelSection:
        self.to_shape()  # the one model shape checks how the numbers fit together (a ValueError names them)
        return self

    def to_shape(self) -> ModelShape:
        """The model as the checkpoint rules, the search and the built-in workloads take it."""
        return ModelShape(**(self.model_dump() | {"num_query_groups": self.query_groups}))

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
            problems.append(f"{where}: pp({layout.pp}) * vpp({layout.vpp}) = {stages} does not divide "
                            f"model.num_layers({self.num_layers})")
        if layout.ep > 1 and self.num_experts == 0:
            problems.append(f"{where}: ep({layout.ep}) > 1 needs a MoE model, model.num_experts is 0")
        if self.num_experts and self.num_experts % layout.ep:
            problems.append(f"{where}: ep({layout.ep}) does not divide model.num_experts({self.num_experts})")
        if layout.cp > 1 and self.seq_length % (2 * layout.cp):
            problems.append(f"{where}: 2 * cp({layout.cp}) does not divide model.seq_length({self.seq_length})")
        return problems


class OptimizerSection(Section):
    """The optimizer of the runs this job starts (and of the configs the search emits)."""

    name: Literal["adam", "adamw"] = "adamw"
    """adam or adamw (decoupled weight decay)"""
    lr: PositiveFloat = 3e-4
    """the peak learning rate"""
    min_lr: float = Field(default=0.0, ge=0)
    """the learning rate at the end of the decay"""
    weight_decay: float = Field(default=0.0, ge=0)
    """weight decay"""
    beta1: float = Field(default=0.9, ge=0, lt=1)
    """Adam's beta1"""
    beta2: float = Field(default=0.95, ge=0, lt=1)
    """Adam's beta2"""
    eps: PositiveFloat = 1e-8
    """Adam's epsilon"""
    grad_clip: float = Field(default=1.0, ge=0, description="0 disables clipping")


class ScheduleSection(Section):
    """The learning-rate schedule: linear warm-up, then decay to min_lr."""

    warmup_steps: int = Field(default=0, ge=0)
    """steps of linear warm-up from 0 to lr"""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """the decay from lr to min_lr after warm-up"""
    decay_steps: PositiveInt | None = None  # None: train_steps
    """steps until min_lr is reached, warm-up included; default: training.train_steps"""


class TrainingSection(Section):
    """The training recipe shared by baseline and target runs."""

    global_batch_size: PositiveInt
    """samples per optimizer step, kept at every layout (micro batch x dp x accumulation)"""
    micro_batch_size: PositiveInt = 1
    """samples per forward/backward on one rank"""
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    """the training dtype: fp32, bf16 (with fp32 master weights) or fp16 (with loss scaling)"""
    optimizer: OptimizerSection = OptimizerSection()
    lr_schedule: ScheduleSection = ScheduleSection()
    seed: int = Field(default=1234, ge=0)
    """the random seed of the runs this job starts"""
    train_steps: PositiveInt = 100
    """optimizer steps of a baseline or target run that the train stage starts"""

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
    """Weights & Biases: one run per job, resumed on every rerun, grouped by the job."""

    enabled: bool = False
    """log to Weights & Biases"""
    mode: Literal["offline", "online", "disabled"] = "offline"
    """offline (a local run folder, `wandb sync` later), online (WANDB_MODE=online overrides), or disabled"""
    project: str = "migrate"
    """the W&B project"""
    entity: str | None = None
    """the W&B entity (team or user); default: the logged-in user's"""
    group: str | None = None
    """the W&B group; default: the job's name"""


class TrackingSection(Section):
    """Where progress goes: JSONL always; TensorBoard and W&B when enabled."""

    tensorboard: bool = False
    """also write TensorBoard events (baseline and target as separate runs under work_dir/tensorboard)"""
    wandb: WandbSection = WandbSection()


class JobSpec(Section):
    """A whole migration job, as written in YAML."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """the job's name: letters, digits, _ . - (names the work_dir and the W&B run)"""
    description: str = ""
    """free text, shown in the report"""
    work_dir: str = Field(default="runs/{name}", description="relative paths are relative to the job file")
    source: SourceSection
    target: TargetSection
    model: ModelSection
    training: TrainingSection
    stages: dict[str, dict[str, Any] | None] = Field(default_factory=dict)
    """the checklist stages to run and their options (see Stages below)"""
    tracking: TrackingSection = TrackingSection()

    @model_validator(mode="after")
    def _cross_checks(self) -> JobSpec:
        problems: list[str] = []
        layouts: list[tuple[str, ParallelLayout, int | None]] = [("source.layout", self.source.layout.to_layout(), None)]
        if self.target.layout is not None:
            layouts.append(("target.layout", self.target.layout.to_layout(), self.target.micro_batch_size))
        for where, layout, micro in layouts:
            problems += self.model.check_layout(layout, where)
            problems += self.training.check_layout(layout, where, micro)
        if problems:
            raise ValueError("; ".join(problems))
        return self


LAYOUT_AXES = AXES

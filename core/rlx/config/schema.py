"""The config's schema: one pydantic section per concern, each field with an inline comment saying what it
does (``rl config show`` prints the tree with its defaults), the checks across sections (`rlx.config.modes`), and the
decisions derived from several keys (`records_routing`, `engines_offload`, `trainer_offloads`).

Every section forbids unknown keys, so a typo is an error, never a no-op.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import yaml

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)


#: A config value as YAML or --set gave it, before the schema validates it (what a `mode="before"` validator sees).
Raw = Any


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ComponentSpec(Section):
    """A component selected by name, with arguments for its own ``Config``."""

    name: str  # the registered component name (`rl plugins` lists them)
    args: dict[str, Any] = Field(default_factory=dict)  # validated by the component's Config class

    @classmethod
    def coerce(cls, v: Raw) -> Raw:
        return {"name": v} if isinstance(v, str) else v


class RewardSpec(ComponentSpec):
    weight: float = 1.0  # the combined reward is the weighted sum of every reward's score


class RunConfig(Section):
    name: str = "rlx"  # run name, used in logs and the default output directory
    output_dir: str = "runs/rlx"  # checkpoints, metrics.jsonl and plots go here
    seed: int = 1234  # seeds python, numpy and torch; data order and sampling follow from it
    deterministic: bool = False  # a run repeats bit for bit, slower (the reproducibility guide says what and how)
    loggers: list[ComponentSpec] = Field(default_factory=list)  # experiment trackers (`rl plugins`: loggers)
    log_samples_interval: int = Field(10, ge=1)  # loggers get a table of sample responses every N steps

    @field_validator("loggers", mode="before")
    @classmethod
    def _loggers(cls, v: Raw) -> Raw:
        return [ComponentSpec.coerce(x) for x in v] if isinstance(v, list) else v


class ModelConfig(Section):
    path: str  # HF checkpoint directory (config.json, tokenizer, safetensors)
    tokenizer: str | None = None  # tokenizer directory, when not the model's own
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    # the kernel for each op a model runs through the kernels hook (op -> kernel name, e.g. {gdn: flashqla}, or
    # auto: the most preferred one that can run); unnamed ops are auto, except matmul: torch's own CPU aten::mm
    # unless named (auto measures whether oneDNN pays on this CPU; onednn takes it)
    kernels: dict[str, str] = Field(default_factory=dict)
    # what --save-hf writes: auto, the trainer's weights (bf16 on GPU, fp32 on CPU; an FP8 checkpoint's weights
    # dequantised); fp8, the weights an FP8 model.path stores quantised, quantised again from the trained ones (its
    # block size, scales recomputed)
    export_weights: Literal["auto", "fp8"] = "auto"


class DataSource(Section):
    """One dataset of a mixture (``data.mix``); a column key left unset is ``data``'s own."""

    path: str  # JSONL or Parquet file, or a folder `datasets` saved (save_to_disk), relative to the config file
    weight: float = Field(1.0, gt=0)  # its prompts are drawn in proportion to its weight among the mixture's
    prompt_key: str | None = None  # this dataset's columns, where they differ from data's
    messages_key: str | None = None  # (data.messages_key, ...)
    label_key: str | None = None
    metadata_key: str | None = None


class DataConfig(Section):
    # JSONL or Parquet prompt file, or a folder `datasets` saved (save_to_disk), relative to the config file
    path: str | None = None
    mix: list[DataSource] = Field(default_factory=list)  # several datasets drawn by weight, instead of path
    prompt_key: str = "prompt"  # column holding a plain-text prompt
    messages_key: str | None = None  # column holding chat messages instead of a prompt
    label_key: str = "label"  # column holding the reference answer given to rewards
    metadata_key: str | None = None  # column copied into Sample.metadata
    apply_chat_template: bool = True  # wrap prompts with the tokenizer's chat template
    on_bad_row: Literal["skip", "error"] = "error"  # a malformed row: report and skip, or stop
    shuffle: bool = True  # reshuffled each epoch from run.seed
    max_prompt_tokens: int | None = Field(None, ge=1)  # longer prompts (after the chat template) are too long;
    #                                                   None: the engines' context length minus one
    on_long_prompt: Literal["skip", "error"] = "skip"  # a too-long prompt: skip it (counted, first one named) or stop

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.path is not None and self.mix:
            raise ValueError("set data.path (one dataset) or data.mix (several), not both")
        return self

    def reading(self, s: DataSource) -> DataConfig:
        """This section as it reads dataset `s` (a mixture's source, a LoRA adapter's data): its path, with its own
        column keys where it sets them."""
        keys = ("prompt_key", "messages_key", "label_key", "metadata_key")
        return self.model_copy(update={"path": s.path, "mix": [],
                                       **{k: getattr(s, k) for k in keys if getattr(s, k) is not None}})


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0.0)  # 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1  # -1: no top-k
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_new_tokens: int = Field(256, ge=1)
    stop: list[str] = Field(default_factory=list)  # stop strings (not included in the output)
    stop_token_ids: list[int] = Field(default_factory=list)  # extra stop ids beside the tokenizer's EOS
    ignore_eos: bool = False  # generate max_new_tokens whatever the model samples (benchmarks, tests)


class SpeculativeConfig(Section):
    """Speculative decoding in this group's engines: drafts verified by the model in one forward, the tokens
    following the model's own distribution (rejection sampling), so that training sees the policy's samples."""

    method: Literal["ngram", "mtp", "draft_model"]  # ngram: drafts looked up in the request's own tokens; mtp:
    #   from the checkpoint's first multi-token-prediction layer (SGLang's EAGLE), which follows the pushes of a run
    #   that trains it (train.objective.mtp_loss_coef); draft_model: drawn from a smaller model with the same
    #   tokenizer (SGLang's STANDALONE), not trained
    num_draft_tokens: int = Field(4, ge=1, le=32)  # drafted tokens verified per step (SGLang's
    #   --speculative-num-draft-tokens counts the last token too: this plus one)
    draft_model: str | None = None  # draft_model: its checkpoint (a folder or builtin://, as model.path)

    @model_validator(mode="after")
    def _draft(self) -> SpeculativeConfig:
        if (self.method == "draft_model") != (self.draft_model is not None):
            raise ValueError("draft_model: names the draft of method draft_model, and only of it")
        return self


class EngineGroupConfig(Section):
    """One group of identical engine servers; several groups make a topology."""

    name: str = "default"  # used in logs and metrics
    backend: Literal["embedded", "sglang"] = "embedded"  # sglang: on a GPU, or on a CPU (scripts/sglang-cpu-env)
    python: str | None = None  # sglang: the interpreter that runs its servers (None: rlx's own), e.g. the one
    #   scripts/sglang-cpu-env makes; relative to the config file
    num_engines: int = Field(1, ge=1)  # servers in this group
    model_path: str | None = None  # defaults to model.path
    tp_size: int = Field(1, ge=1)  # tensor parallel size of each server (sglang)
    mem_fraction_static: float | None = Field(None, gt=0, le=1)  # sglang's --mem-fraction-static
    worker_type: Literal["regular", "prefill", "decode"] = "regular"  # prefill/decode: PD disaggregation
    update_weights: bool = True  # whether this group receives the trainer's weights
    server_args: dict[str, Any] = Field(default_factory=dict)  # passed through as --key value
    speculative: SpeculativeConfig | None = None  # speculative decoding (None: none)

    @model_validator(mode="after")
    def _python(self) -> EngineGroupConfig:
        if self.python is not None and self.backend != "sglang":
            raise ValueError("python: names the interpreter of SGLang servers; the embedded engine runs in rlx's "
                             "own (set backend: sglang, or leave python out)")
        return self


class TeacherConfig(EngineGroupConfig):
    """A teacher of on-policy distillation: another model, served by engines of its own (the same engine stack,
    launched as a group or attached by address), never trained, that scores the student's own samples token by
    token (``train.objective.distill``). It must share the student's tokenizer (checked at preflight)."""

    name: str  # names the teacher in metrics (distill/<name>/reverse_kl) and in rows (rollout.teacher_field)
    urls: list[str] = Field(default_factory=list)  # attach to these engines instead of launching the group (their
    #   model_path, if given, is only compared with the student's tokenizer)
    update_weights: bool = False  # a teacher is never trained: it gets no weights

    @model_validator(mode="after")
    def _teacher(self) -> TeacherConfig:
        if self.update_weights:
            raise ValueError("update_weights: a teacher is not trained, so it gets no weights")
        if self.worker_type != "regular" or self.speculative is not None:
            raise ValueError("worker_type and speculative apply to the engines that generate; a teacher scores "
                             "(one forward per sample)")
        if not self.urls and self.model_path is None:
            raise ValueError("model_path: the teacher's checkpoint (or urls: its engines, to attach to them)")
        launch = ("backend", "python", "num_engines", "tp_size", "mem_fraction_static", "server_args")
        # (against the defaults, not the keys given: a dumped config has them all)
        set_ = [k for k in launch if getattr(self, k) != EngineGroupConfig.model_fields[k].get_default(
            call_default_factory=True)]
        if self.urls and set_:
            raise ValueError(f"{set_[0]}: says how to launch the teacher's engines, and urls attaches to running "
                             f"ones (model_path, beside urls, names its checkpoint for the tokenizer check)")
        return self


class RouterConfig(Section):
    enabled: bool | None = None  # None: use the router when there is more than one engine
    policy: Literal["cache_aware", "round_robin", "power_of_two", "random"] = "cache_aware"
    port: int | None = None  # None: a free port
    args: dict[str, Any] = Field(default_factory=dict)  # passed through to sglang-router as --key value


class FaultToleranceConfig(Section):
    """What happens when an engine dies or freezes (`rlx.rollout.engines.health`): it is probed, taken out of
    the router and of weight sync, its requests are sent again to the others, it is restarted (launched
    engines) or waited for (attached ones), brought to the trainer's weights and let back in."""

    enabled: bool = True  # false: the first engine failure ends the run (after rollout.requests.retries)
    probe_interval_s: float = Field(2.0, gt=0)  # how often each engine's /health is asked
    probe_timeout_s: float = Field(10.0, gt=0)  # a probe unanswered this long failed
    failures: int = Field(3, ge=1)  # consecutive failed probes that take an engine out (a frozen one)
    restart: bool = True  # restart a launched engine that was taken out (attached ones rejoin when healthy)
    max_restarts: int = Field(3, ge=0)  # per engine; past it the engine stays out and the run goes on without it
    recovery_timeout_s: float = Field(600, gt=0)  # how long a request waits for any engine to serve again
    max_resends: int = Field(3, ge=0)  # how often one request is sent again after engine failures


def unique_rewards(specs: list[RewardSpec] | None) -> list[RewardSpec] | None:
    """Each reward once: its score is kept and logged under its name (``reward/<name>/mean``)."""
    names = [s.name for s in specs or []]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"reward {twice[0]!r} is listed twice; a reward's score is kept and logged under its "
                         f"name, so list each once")
    return specs


#: A list of rewards: each given by name or as ``{name, args, weight}``, each once (`unique_rewards`).
RewardSpecs = Annotated[list[RewardSpec],
                        BeforeValidator(lambda v: [ComponentSpec.coerce(x) for x in v] if isinstance(v, list) else v),
                        AfterValidator(unique_rewards)]


class DynamicSamplingConfig(Section):
    """Group filters (DAPO's dynamic sampling): groups a filter drops (this one, or a plugin's ``filter_group``)
    are replaced by groups of fresh prompts."""

    filter_zero_variance: bool = False  # drop groups whose rewards are all equal (no GRPO signal)
    max_rounds: int = Field(4, ge=1)  # at most this many x n_prompts fresh prompts a step to fill the batch


class PartialRolloutConfig(Section):
    """Sync mode: in-flight requests are aborted at a step boundary and resume from their prefix the next step."""

    enabled: bool = False
    over_sampling: float = Field(1.0, ge=1.0)  # start this many x n_prompts groups; the first to finish are kept


class RequestsConfig(Section):
    """The generate requests a rollout sends to the engines."""

    timeout_s: float = Field(600, gt=0)  # one generate request, end to end
    retries: int = Field(0, ge=0)  # immediate retries of a request that failed on an unreachable engine
    max_concurrency: int = Field(64, ge=1)  # generator calls in flight at once
    coalesce: bool | None = None  # identical generate requests issued together (a group's samples) go as one
    #   request with n = their count (SGLang's parallel sampling: one prefill, n continuations); None: on, except
    #   with prefill/decode workers, whose parallel sampling SGLang has had bugs in (shared bootstrap rooms)


class ScoringConfig(Section):
    """Where sync rewards run and for how long (`rlx.rollout.rewards`): worker processes (a reward that hangs or
    crashes is killed and its worker replaced) or threads of this process (for rewards that cannot be pickled)."""

    isolation: Literal["process", "thread"] = "process"
    workers: int = Field(4, ge=1)  # rewards scored at once (worker processes or threads)
    timeout_s: float = Field(60, gt=0)  # per sample and reward; a time-out marks the sample FAILED
    #   (process: from when a worker starts it, and the worker is killed; thread: from the call)
    load_timeout_s: float = Field(300, gt=0)  # process: starting a worker and loading a reward into it
    #                                           (imports included; not counted in timeout_s)


class BufferConfig(Section):
    """The rollout buffer service (``rollout.source: buffer``)."""

    port: int = Field(0, ge=0, le=65535)  # the port on 127.0.0.1 (0: any free port)
    api_key: str | None = None  # the bearer key clients send (None: a random one, printed)
    max_body_mb: float = Field(64, gt=0)  # a larger POST is refused (413) before it is read
    max_metadata_kb: float = Field(64, gt=0)  # a group's metadata (kept in checkpoints until trained)


class RolloutConfig(Section):
    n_prompts: int = Field(8, ge=1)  # prompts per rollout step
    n_samples_per_prompt: int = Field(4, ge=1)  # samples per prompt (the GRPO group size)
    generator: ComponentSpec = Field(default_factory=lambda: ComponentSpec(name="single_turn"))
    rewards: RewardSpecs = Field(default_factory=list)  # combined by weighted sum
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    engines: list[EngineGroupConfig] = Field(default_factory=lambda: [EngineGroupConfig()])  # the topology
    external_engines: list[str] = Field(default_factory=list)  # attach to these URLs instead of launching
    router: RouterConfig = Field(default_factory=RouterConfig)
    startup_timeout_s: float = Field(600, gt=0)  # how long an engine may take to become healthy
    requests: RequestsConfig = Field(default_factory=lambda: RequestsConfig())  # generate requests to the engines
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)  # dead/frozen engines
    scoring: ScoringConfig = Field(default_factory=lambda: ScoringConfig())  # where and how long rewards run
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=lambda: DynamicSamplingConfig())
    partial_rollout: PartialRolloutConfig = Field(default_factory=lambda: PartialRolloutConfig())
    routed_experts: bool = False  # MoE: engines report the experts each token was routed to (SGLang's
    #   --enable-return-routed-experts, set on engines rlx launches), and the trainer logs how often its own
    #   routing agrees (moe/routing_agreement); train.objective.routing_replay implies it
    teachers: list[TeacherConfig] = Field(default_factory=list)  # on-policy distillation: models scoring the samples
    teacher_field: str | None = None  # several teachers: the Sample.metadata key (the row's metadata) naming each
    #   row's teacher; rows without it are not distilled (None: every row, by the one teacher)
    # what the engines that get the trainer's weights serve: None, its weights as they are; fp8, block-quantised FP8
    # (e4m3, 128x128 scales: engines launched from an FP8 copy of the model, or from model.path when it is an FP8
    # checkpoint, and every push quantised on the trainer's side, about half a bf16 push's bytes); int4, weight-only
    # INT4 (groups of 128 input columns; the embedded engine; a quarter of a bf16 push)
    quantization: Literal["fp8", "int4"] | None = None
    offload_during_train: bool | None = None  # engines release memory while the trainer steps (None: on when
    #                                           ray.placement is colocated on GPUs; sync mode only)
    # buffer: train on trajectories POSTed by external agents; replay: on saved batches (rollout.replay), no engines
    source: Literal["generate", "buffer", "replay"] = "generate"
    buffer: BufferConfig = Field(default_factory=lambda: BufferConfig())  # source: buffer: the service
    replay: str | None = None  # source: replay: batches saved (save_batches, rl rollout), a file or folder of them
    save_batches: bool = False  # write each step's batch, whole, to <output_dir>/batches/step-<k>.jsonl
    output: str | None = None  # rl rollout: where to write groups (default <output_dir>/rollout.jsonl)
    num_steps: int = Field(1, ge=1)  # rl rollout: how many rollout steps to run

    @field_validator("generator", mode="before")
    @classmethod
    def _generator(cls, v: Raw) -> Raw:
        return ComponentSpec.coerce(v)

    @model_validator(mode="after")
    def _teachers(self) -> RolloutConfig:
        names = [t.name for t in self.teachers]
        if len(set(names)) < len(names):
            raise ValueError(f"teachers: names must be unique (they name the metrics and rows' teachers): {names}")
        if len(self.teachers) > 1 and self.teacher_field is None:
            raise ValueError("teacher_field: with several teachers, the metadata key naming each row's teacher")
        if self.teacher_field is not None and not self.teachers:
            raise ValueError("teacher_field: names rows' teachers, and rollout.teachers lists none")
        return self

    @model_validator(mode="after")
    def _coalesce(self) -> RolloutConfig:
        if self.requests.coalesce and self.disaggregated:
            raise ValueError("requests.coalesce: with prefill/decode workers (rollout.engines[*].worker_type) a "
                             "group's samples go as separate requests: SGLang's parallel sampling (n) has given "
                             "all n samples one bootstrap room there; leave it unset or false")
        return self

    @property
    def disaggregated(self) -> bool:
        return any(g.worker_type != "regular" for g in self.engines)

    @property
    def coalesces(self) -> bool:
        """Whether a group's identical requests go as one with n (`requests.coalesce`, by default on)."""
        return self.requests.coalesce is not False and not self.disaggregated


class ParallelConfig(Section):
    """How a model's ranks split the work (Megatron's layout)."""

    world_size: int = Field(1, ge=1)  # trainer processes; data parallel size = world_size / (tp * pp)
    tp: int = Field(1, ge=1)  # tensor parallel size
    pp: int = Field(1, ge=1)  # pipeline parallel size (stages split the layers evenly)
    ep: int = Field(1, ge=1)  # expert parallel size (MoE models): each rank holds 1/ep of the experts
    etp: int | None = Field(None, ge=1)  # expert tensor parallel size (None: the same as tp)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp


class OptimConfig(Section):
    """Adam with Megatron's distributed optimizer, and its learning-rate schedule."""

    lr: float = Field(1e-6, gt=0)
    min_lr: float = Field(0.0, ge=0)  # cosine decay floor (with lr_decay: cosine)
    lr_decay: Literal["constant", "cosine"] = "constant"
    lr_warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = Field(1.0, ge=0)  # global gradient-norm clip (0: off)


class CriticConfig(Section):
    """The critic of value-based estimators (``train.objective.advantage: gae``): the policy's architecture with
    a scalar value head, trained before the actor each step. Without ``parallel`` it lives in the actor's ranks
    with the actor's layout; with it, in ranks of its own (Ray actors placed on the actor's bundles)."""

    model_path: str | None = None  # HF checkpoint to start from (None: model.path); its score.weight [1, hidden],
    #                                if there is one, starts the value head (else every value starts at 0)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    value_clip: float | None = Field(0.2, gt=0)  # clip the new values to within this of the step's old ones
    #                                             (PPO's clipped value loss; None: plain squared error)
    warmup_steps: int = Field(0, ge=0)  # the first N steps train the critic alone (the policy waits)
    parallel: ParallelConfig | None = None  # a layout of its own, in processes of its own (Ray); None: the actor's
    placement: Literal["shared", "own"] = "shared"  # with parallel: on the actor's bundles (GPUs shared), or on
    #                                                 bundles of its own (ray.cpus/gpus_per_trainer each)


class DistillConfig(Section):
    """On-policy distillation: the per-token reverse KL from the student to its teacher (``rollout.teachers``), on
    the student's own samples and their model-sampled tokens only, alone or beside the task reward."""

    coef: float = Field(1.0, gt=0)  # weight of the KL beside the task reward's advantage
    # token: the sampled token's log-prob under the sampler minus under the teacher, subtracted from each token's
    #   advantage (a per-token reward: slime's OPD, Thinking Machines'); top_k: a loss term, the KL over the
    #   teacher's top_k tokens and one bucket for the rest, from the student's full distribution (differentiable)
    estimator: Literal["token", "top_k"] = "token"
    top_k: int = Field(20, ge=1)  # top_k: the teacher's top log-probs per position, asked of its engines

    @model_validator(mode="after")
    def _top_k(self) -> DistillConfig:
        if self.estimator != "top_k" and self.top_k != 20:
            raise ValueError("top_k: the width of the top_k estimator (estimator is token)")
        return self


class ObjectiveConfig(Section):
    """What the policy optimises: advantages, the policy loss and the terms added to it."""

    advantage: ComponentSpec = Field(default_factory=lambda: ComponentSpec(name="grpo"))  # estimator
    loss: ComponentSpec = Field(default_factory=lambda: ComponentSpec(name="ppo_clip"))  # policy loss
    # what every unit of loss is averaged over (None: the policy loss's own: sequence for gspo, else token)
    loss_norm: Literal["token", "sequence", "group"] | None = None
    kl_coef: float = Field(0.0, ge=0)  # KL penalty against the initial policy (0: no reference model)
    kl_type: Literal["k1", "k2", "k3", "low_var", "unbiased"] = "low_var"  # unbiased: k3 x ratio to old policy
    kl_in_reward: bool = False  # the KL penalty goes into the per-token reward (kl_type, before the step) instead of
    #                            the loss, so a critic learns KL-shaped returns (estimators with a critic: gae)
    entropy_coef: float = 0.0  # entropy bonus
    tis_cap: float | None = Field(None, gt=0)  # importance sampling between engine and trainer log-probs (None: off)
    tis_low: float | None = Field(None, ge=0)  # lower bound of the weights (None: none; with mask: two-sided)
    tis_mode: Literal["truncate", "mask"] = "truncate"  # weights outside [tis_low, tis_cap]: clamp, or drop tokens
    tis_level: Literal["token", "sequence", "geometric"] = "token"  # a ratio per token, or per sequence (the
    #                                                product of its token ratios, or their geometric mean)
    routing_replay: bool = False  # MoE, rollout routing replay (R3): the trainer's routers take the experts the
    #                               engine routed each token to, in the policy and the reference
    # DeepSeek sparse attention (GLM-5, DeepSeek-V3.2): 0 keeps the indexer as loaded (RL gives it no gradient);
    # above 0, each layer's indexer is trained toward the attention's distribution over the keys it kept (KL,
    # DeepSeek-V3.2's sparse-stage loss) with this coefficient, and pushed with the rest
    indexer_kl_coef: float = Field(0.0, ge=0)
    # multi-token-prediction layers (num_nextn_predict_layers: DeepSeek-V3, GLM-4.5...), which engines draft with: 0
    # keeps them as loaded (not pushed; export writes them back unchanged); above 0 they train on the response tokens
    # (cross entropy, this coefficient; the policy's gradient unchanged, though clip_grad's norm counts theirs) and are
    # pushed with the rest
    mtp_loss_coef: float = Field(0.0, ge=0)

    distill: DistillConfig | None = None  # on-policy distillation from rollout.teachers (None: none)

    @field_validator("advantage", "loss", mode="before")
    @classmethod
    def _component(cls, v: Raw) -> Raw:
        return ComponentSpec.coerce(v)

    @model_validator(mode="after")
    def _tis_bounds(self) -> ObjectiveConfig:
        if self.tis_low is not None and self.tis_cap is None:
            raise ValueError("tis_low is a bound of importance sampling, which is off: set tis_cap too")
        if self.tis_low is not None and self.tis_cap is not None and self.tis_low > self.tis_cap:
            raise ValueError(f"tis_low ({self.tis_low}) must not exceed tis_cap ({self.tis_cap})")
        return self


class AsyncConfig(Section):
    """train.mode: async only: how far generation may run ahead of training (run.deterministic's async mode has a
    fixed schedule instead: one step ahead)."""

    max_staleness: int = Field(1, ge=0)  # a group may lag the trainer by at most this many weight versions
    stale_groups: Literal["regenerate", "drop"] = "regenerate"  # what happens to a group past max_staleness
    mask_stale_tokens: bool = False  # mask tokens past max_staleness instead of handling their whole group
    swap: Literal["pause", "drain"] = "pause"  # weight push: pause generation only for the swap (in-flight
    #                                            requests go on with the new weights), or let them finish first


class CheckpointConfig(Section):
    interval: int = Field(0, ge=0)  # checkpoint every N steps (0: only at the end)
    keep: int = Field(2, ge=1)  # newest checkpoints kept on disk
    async_save: bool = False  # trainer ranks copy their state into host memory and train on while it is written
    #                           (a checkpoint once every file is): for GPU trainers; on CPU the writes take the
    #                           cores the run trains on (the training guide has the figures)


#: the HF (peft) module names LoRA can target (`rlx.train.lora.PROJECTIONS`: megatron fuses q/k/v and gate/up)
LoRATarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj",
                     "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                     # gated delta nets' (Qwen3-Next: in_proj_qkvz, in_proj_ba; Qwen3.5: in_proj_qkv, _z, _b, _a)
                     "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
#: what LoRA adapts unless told: attention's and the MLPs' projections (peft's usual "all linear" of a decoder)
LORA_TARGETS: tuple[LoRATarget, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAAdapterConfig(Section):
    """One adapter of a multi-LoRA run (``train.lora.adapters``): its prompts and rewards. Its rank, alpha and
    targets are ``train.lora``'s."""

    name: str = Field(pattern=r"^[A-Za-z0-9_]+$", max_length=40)  # engines serve it as <name>-v<version>-<hex>
    # its prompts (read with data's keys where it sets none); weight: its share of each step's prompts
    data: DataSource
    rewards: RewardSpecs | None = None  # default: rollout.rewards


class LoRAConfig(Section):
    """LoRA on the actor (`rlx.train.lora`): adapters on the decoder layers' projections (experts' too), fp32, the
    rest of the model frozen; the optimizer holds the adapters only. Engines get the adapters (``push: adapter``: they
    serve base + adapter, and only the adapter's bytes travel) or the merged weights (``push: merged``)."""

    rank: int = Field(16, ge=1)  # r
    alpha: float = Field(32.0, gt=0)  # the adapter's output is scaled by alpha / rank
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapter's input, in training forwards (peft's lora_dropout)
    # peft's names of the projections to adapt (q/k/v, and gate/up, are fused in megatron: all or none of each); one
    # the model lacks is an error (the default: those of these the model has)
    target_modules: list[LoRATarget] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)
    # adapter: engines load each version's adapter (SGLang's LoRA routes, launched with --enable-lora) and requests
    # name it; merged: engines get W + (alpha / rank) B A as full weights (any transport, quantised rollouts, experts)
    push: Literal["adapter", "merged"] = "adapter"
    # multi-LoRA: several adapters over the one base model, each with its own data and rewards, sampled by the same
    # engines at once and trained together in each step (none: one adapter, on data and rollout.rewards)
    adapters: list[LoRAAdapterConfig] = Field(default_factory=list)

    @field_validator("adapters")
    @classmethod
    def _adapters(cls, v: list[LoRAAdapterConfig]) -> list[LoRAAdapterConfig]:
        names = [a.name for a in v]
        if len(v) == 1:
            raise ValueError("lists one adapter: one adapter is train.lora without adapters (on data and "
                             "rollout.rewards); list two or more to train several")
        if len(set(names)) < len(names):
            raise ValueError(f"adapter names must be unique (they name the adapters engines serve, samples and "
                             f"metrics): {names}")
        return v

    @property
    def names(self) -> list[str | None]:
        """The adapters the run trains by name: one, None, without ``adapters``."""
        return [a.name for a in self.adapters] or [None]


class TrainConfig(Section):
    """The Megatron trainer (the actor role), its optimizer and the RL objective.

    ``parallel`` and ``optim`` are the actor's; the reference model (with ``objective.kl_coef > 0``) lives
    in the actor's ranks with the actor's layout.
    """

    mode: Literal["sync", "async"] = "sync"  # async: rollout keeps generating while the trainer trains
    num_steps: int = Field(100, ge=1)  # rollout + train steps
    max_restarts: int = Field(0, ge=0)  # a trainer rank that dies: start the trainers again from this run's newest
    #                                   checkpoint this many times (Ray only), instead of ending the run
    updates_per_step: int = Field(1, ge=1)  # optimizer steps per rollout batch (mini-batches)
    max_tokens_per_micro_batch: int = Field(8192, ge=1)  # packed tokens per forward/backward
    row_tokens: int | None = Field(None, ge=1)  # packed row length (None: a micro-batch is one row, no padding);
    #                                             shorter rows are padded to the longest; attention is per sample
    balancer: ComponentSpec = Field(default_factory=lambda: ComponentSpec(name="tokens"))  # split across DP ranks
    logprob_diff_threshold: float = Field(0.5, gt=0)  # probe: count tokens whose trainer and engine log-probs
    #                                                   differ by more than this
    # colocated offload: the trainer moves its GPU memory to the host while engines on its GPU generate, and keeps
    # only the model at work resident (rlx.train.offload; None: as rollout.offload_during_train)
    offload: bool | None = None
    # quantisation-aware training for low-precision rollout: the policy's forward computes with its weights quantised
    # as the engines serve them (straight-through gradient), so that the policy trained is the one sampled; int4 (with
    # rollout.quantization: int4)
    qat: Literal["int4"] | None = None
    # FP8 training (megatron's fp8 format, as slime's --fp8-format): refused (it needs Transformer Engine's layers)
    fp8: Literal["e4m3", "hybrid"] | None = None
    lora: LoRAConfig | None = None  # train low-rank adapters instead of the whole actor (None: the whole actor)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)  # used by estimators with a critic (gae)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    @field_validator("balancer", mode="before")
    @classmethod
    def _component(cls, v: Raw) -> Raw:
        return ComponentSpec.coerce(v)

    @field_validator("fp8")
    @classmethod
    def _fp8(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("FP8 training runs megatron's FP8 recipes through Transformer Engine's layers, and rlx "
                             "builds megatron's local layers (Transformer Engine is in neither rlx's environments nor "
                             "its GPU bundle): train in bf16, and serve FP8 with rollout.quantization: fp8")
        return v


class CpuConfig(Section):
    """CPU threads of the trainer ranks and engines (`rlx.cpu`): everything that exists for speed on CPUs. GPU runs
    never need it."""

    threads: int | None = Field(None, ge=1)  # torch threads per trainer rank (None: the node's cores shared by its
    #                                         trainer ranks; async with async_cores "split": ray.cpus_per_trainer)
    # async mode, how trainer ranks and engines use a node's cores (rlx.cpu): "share": each gets what it would in
    # sync mode, and threads that wait sleep at once (OMP_WAIT_POLICY=PASSIVE), so the busy phase has the cores the
    # idle one leaves; "split": each keeps the CPUs it reserved (ray.cpus_per_trainer, ray.cpus_per_engine)
    async_cores: Literal["share", "split"] = "share"


class WeightSyncConfig(Section):
    """How the trainer's weights reach the engines (`rlx.transport`): the transport, how often, how each push is
    verified, and how long one call to one engine may take."""

    transport: ComponentSpec = Field(default_factory=lambda: ComponentSpec(name="tensor"))  # tensor, broadcast,
    #                                                              disk, or a plugin's (delta)
    interval: int = Field(1, ge=1)  # push weights to the engines every N steps
    # after each push: "sample" checks the version and a few values of some tensors on every engine; "full"
    # also compares a hash of every tensor every verify_full_interval pushes; "off" checks nothing
    verify: Literal["full", "sample", "off"] = "sample"
    verify_full_interval: int = Field(10, ge=1)
    timeout_s: float = Field(600, gt=0)  # one weight-update call to one engine

    @field_validator("transport", mode="before")
    @classmethod
    def _component(cls, v: Raw) -> Raw:
        return ComponentSpec.coerce(v)

    @field_validator("verify", mode="before")
    @classmethod
    def _verify(cls, v: Raw) -> Raw:
        # YAML reads a bare off/on as a boolean
        return {False: "off", True: "sample"}.get(v, v) if isinstance(v, bool) else v


class RayConfig(Section):
    """Where the trainer ranks and engine servers run."""

    enabled: bool = True  # false: trainer in this process (one rank), engines as local processes
    address: str | None = None  # join this cluster (e.g. "auto" or "ray://host:10001"); None: start one
    num_cpus: int | None = None  # CPUs of a cluster started here (None: all)
    placement: Literal["colocated", "disaggregated"] = "disaggregated"  # engines beside or apart from trainers
    cpus_per_trainer: float = Field(1, gt=0)
    gpus_per_trainer: float = Field(0, ge=0)  # 1 on GPU clusters
    cpus_per_engine: float = Field(1, ge=0)
    gpus_per_engine: float = Field(0, ge=0)  # disaggregated only; colocated engines use the trainers' GPUs
    placement_timeout_s: float = Field(120, gt=0)  # how long to wait for Ray to place every bundle
    log_to_driver: bool = False  # stream actors' output to this terminal


class EvalDatasetConfig(Section):
    """One held-out prompt file, evaluated through the run's engines and generator."""

    name: str  # metrics are eval/<name>/...
    path: str  # JSONL, Parquet or a `datasets` folder, read with the data section's keys (prompt_key, label_key, ...)
    n_samples: int = Field(1, ge=1)  # samples per prompt: pass@k for k = 1 and n_samples
    max_prompts: int | None = Field(None, ge=1)  # the first N prompts of the file (default: all)
    # sampling: default the rollout's, greedy (temperature 0) when n_samples is 1; given, it replaces it
    sampling: SamplingConfig | None = None
    rewards: RewardSpecs | None = None  # default: its adapter's, or rollout.rewards
    adapter: str | None = None  # multi-LoRA: the train.lora.adapters entry that answers (None: the base model)
    correct_at: float = 1.0  # a sample is correct (pass@k, success rate) when its reward is at least this

    def effective_sampling(self, rollout: SamplingConfig) -> SamplingConfig:
        if self.sampling is not None:
            return self.sampling
        return rollout.model_copy(update={"temperature": 0.0}) if self.n_samples == 1 else rollout


class EvalConfig(Section):
    """Evaluation on held-out prompts during training (and by `rl eval`)."""

    datasets: list[EvalDatasetConfig] = Field(default_factory=list)  # held-out datasets, each scored on its own
    interval: int = Field(0, ge=0)  # evaluate after every N training steps (0: not during training)
    at_start: bool = True  # and the initial policy, before the first step (not on --resume)

    @field_validator("datasets")
    @classmethod
    def _unique(cls, v: list[EvalDatasetConfig]) -> list[EvalDatasetConfig]:
        names = [d.name for d in v]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"dataset names must be unique (they name the metrics): {dupes}")
        return v


class Config(Section):
    """The root of the tree: one field per subsystem."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    cpu: CpuConfig = Field(default_factory=CpuConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_data(), sort_keys=False)

    def to_data(self) -> dict[str, Any]:
        """The tree as plain data, with the YAML spelling of every key (``train.async``)."""
        return self.model_dump(mode="json", by_alias=True)

    def to_json(self) -> str:
        """The tree as JSON; `parse_config` reads it back to the same tree (paths already absolute)."""
        return self.model_dump_json(by_alias=True)


# Components selected by name in the tree: (key path, kind).
COMPONENT_FIELDS: list[tuple[tuple[str, ...], str]] = [
    (("rollout", "generator"), "generators"),
    (("rollout", "rewards"), "rewards"),
    (("train", "objective", "advantage"), "advantages"),
    (("train", "objective", "loss"), "losses"),
    (("weight_sync", "transport"), "transports"),
    (("train", "balancer"), "balancers"),
    (("run", "loggers"), "loggers"),
]

# File paths in the tree, made absolute when the config is loaded (relative to the config file), so that
# workers and engines in other folders or on other hosts never re-parse or guess.
PATH_FIELDS: list[tuple[str, ...]] = [
    ("model", "path"), ("model", "tokenizer"), ("data", "path"), ("run", "output_dir"), ("rollout", "output"),
    ("rollout", "replay"), ("train", "critic", "model_path"),
]
#: Those of them that name a model (a folder, builtin://, or a Hugging Face Hub id), beside each engine group's
#: ``model_path``.
MODEL_FIELDS: list[tuple[str, ...]] = [("model", "path"), ("model", "tokenizer"), ("train", "critic", "model_path")]


def records_routing(cfg: Config) -> bool:
    """Whether engines are asked for the experts they routed each token to (``rollout.routed_experts``, or
    routing replay, which needs them)."""
    return cfg.rollout.routed_experts or cfg.train.objective.routing_replay


def adapter_pushes(cfg: Config) -> bool:
    """Whether weight pushes carry the actor's LoRA adapters instead of weights (``train.lora.push: adapter``)."""
    return cfg.train.lora is not None and cfg.train.lora.push == "adapter"


def engines_offload(cfg: Config) -> bool:
    """Whether engines give their GPU memory back while the trainer trains (``rollout.offload_during_train``;
    by default when colocated with GPU trainers); never for attached engines, which are not rlx's."""
    offload = cfg.rollout.offload_during_train
    if offload is None:
        offload = cfg.ray.enabled and cfg.ray.placement == "colocated" and cfg.ray.gpus_per_trainer > 0
    return bool(offload) and not cfg.rollout.external_engines


def launched_groups(cfg: Config) -> list[EngineGroupConfig]:
    """The engine groups the run starts (none when it attaches to engines by address, or replays saved batches):
    the generating ones, then the teachers' (`rlx.rollout.teachers`, started after them)."""
    if cfg.rollout.source == "replay":
        return []
    return [*([] if cfg.rollout.external_engines else cfg.rollout.engines), *(t for t in cfg.rollout.teachers
                                                                               if not t.urls)]


def trainer_offloads(cfg: Config) -> bool:
    """``train.offload``, its default decided as the engines' (`engines_offload`), in sync mode: the memory the
    trainer gives back is what the engines sized their cache by (rlx.train.offload)."""
    if cfg.train.offload is not None:
        return cfg.train.offload
    return cfg.train.mode == "sync" and engines_offload(cfg)


def component_config(component: object, args: dict[str, Any]) -> BaseModel | None:
    """The component's validated ``Config`` instance, or None if it takes no config."""
    conf_cls = getattr(component, "Config", None)
    if conf_cls is None:
        if args:
            raise ValidationError.from_exception_data(
                "args",
                [{"type": "extra_forbidden", "loc": (k,), "input": v} for k, v in args.items()],
            )
        return None
    return conf_cls.model_validate(args)

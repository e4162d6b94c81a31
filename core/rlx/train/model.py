"""A model role: one megatron model with its optimizer, scheduler, checkpoint and forward passes.

Roles are ``actor`` (trained, pushed to the engines), ``reference`` (frozen initial policy, for the KL
penalty) and, for value-based methods, ``critic``. A role knows nothing about RL: it runs megatron's
forward(-backward) schedule over packed micro-batches with a loss function it is given, and converts
its weights to and from HF through the model spec of its bridge.

Choices:

* The model is whatever the `ModelSpec` builds for this rank's `Stage`, wrapped (when trained) in
  megatron's DDP with the DistributedOptimizer. fp32 on CPU, bf16 on GPU (``model.dtype``).
* Weights load tensor by tensor from the HF checkpoint, each rank reading only its own slice
  (`HFCheckpoint.shard`), straight into the allocated parameters: no rank ever holds the whole HF
  state. A frozen role can start from another role's weights in memory instead (the reference from
  the actor, when the layouts are equal), without reading the checkpoint again.
* Forward and backward go through megatron's own schedule (``get_forward_backward_func``): no
  pipelining, or 1F1B across stages with ``variable_seq_lengths``, so packed micro-batches may differ
  in shape. Only the last stage computes losses.
* `hf_tensors` yields the stage's HF tensors one at a time, each gathered over tensor parallelism when
  it is reached, for weight pushes and HF export.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from rlx.errors import RLXError
from rlx.train.megatron_patches import checkpoint as checkpoint_patches
from rlx.train.moe import sum_router_grads
from rlx.train.packing import PackedBatch
from rlx.train.lora import select
from rlx.train.spec import HFCheckpoint, ModelSpec, Stage

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from rlx.config import LoRAConfig, OptimConfig, ParallelConfig


@dataclass
class ParallelState:
    """This rank's place in megatron's layout."""

    rank: int
    world: int
    tp: int
    pp: int
    dp: int
    dp_rank: int
    tp_rank: int
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def gathers(self) -> bool:
        """Whether this rank takes part in gathering its stage's weights (`ModelRole.hf_tensors`): data-parallel
        rank 0's tensor-parallel group, and with expert parallelism every rank (experts live on several
        data-parallel ranks)."""
        return self.dp_rank == 0 or self.ep > 1

    @property
    def sender(self) -> bool:
        """Whether this rank sends its stage's weights (one rank per pipeline stage)."""
        return self.dp_rank == 0 and self.tp_rank == 0


def init_distributed(parallel: ParallelConfig, seed: int, master_addr: str = "127.0.0.1",
                     key: str = "train.parallel", deterministic: bool = False) -> ParallelState:
    """Join (or create, for one process) the default process group and megatron's model-parallel groups.

    `parallel` is a ``ParallelConfig`` (at config `key`, for errors). Outside torchrun/Ray (no ``WORLD_SIZE``) a one-process group
    is created on `master_addr`. `deterministic` (``run.deterministic``): torch's deterministic algorithms from here
    on (the models built after follow it: `ModelRole`), and on GPU what they and megatron's deterministic mode need
    set before NCCL and cuBLAS start.
    """
    import os

    from rlx.train.megatron_patches import cpu

    cpu.enable()
    if deterministic:
        if torch.cuda.is_available():
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's reproducible workspaces
            os.environ.setdefault("NCCL_ALGO", "Ring")  # one reduction order whatever the message size
        torch.use_deterministic_algorithms(True)
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            from rlx.net import free_port

            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR=master_addr,
                              MASTER_PORT=str(free_port(master_addr)))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    world = dist.get_world_size()
    p = parallel
    if world != p.world_size:
        raise RLXError(f"{key}.world_size is {p.world_size} but {world} trainer processes are running")
    if world % (p.tp * p.pp):
        raise RLXError(f"{key}.world_size {world} is not a multiple of tp*pp = {p.tp * p.pp}")
    if world % (p.expert_tp * p.ep * p.pp):
        raise RLXError(f"{key}.world_size {world} is not a multiple of etp*ep*pp = "
                       f"{p.expert_tp * p.ep * p.pp}")
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(p.tp, p.pp, expert_model_parallel_size=p.ep,
                                     expert_tensor_parallel_size=p.expert_tp)
    model_parallel_cuda_manual_seed(seed)
    return ParallelState(
        dist.get_rank(), world, p.tp, p.pp, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(),
        ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
        p.ep, ps.get_expert_model_parallel_rank(), p.expert_tp, ps.get_expert_tensor_parallel_rank())


def stage_of(spec: ModelSpec, par: ParallelState, mtp: int = 0) -> Stage:
    """This rank's stage; with `mtp` multi-token-prediction layers trained, on the last stage."""
    if spec.num_layers % par.pp:
        raise RLXError(f"train.parallel.pp: {par.pp} pipeline stages cannot split the model's "
                       f"{spec.num_layers} layers evenly")
    n = spec.num_layers // par.pp
    return Stage(layer_offset=par.pp_rank * n, num_layers=n, first=par.first_stage, last=par.last_stage,
                 tp_rank=par.tp_rank, tp=par.tp, ep_rank=par.ep_rank, ep=par.ep, etp_rank=par.etp_rank,
                 etp=par.etp, mtp=mtp if par.last_stage else 0)


def torch_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class _LMHeadOptional:
    """An HF checkpoint seen by a critic's bridge: a tensor it lacks reads as empty and is noted in
    `missing`, so that a reward model's checkpoint (a ``score.weight``, no LM head) loads; the critic drops the
    output layer and fails on any other missing tensor."""

    def __init__(self, ckpt: HFCheckpoint):
        self.ckpt, self.folder = ckpt, ckpt.folder
        self.missing: list[str] = []

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ckpt, name)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.ckpt:
            self.missing.append(name)
            return torch.empty(0)
        return self.ckpt.get(name)

    def shard(self, name: str, dim: int, rank: int, parts: int) -> torch.Tensor:
        if name not in self.ckpt:
            self.missing.append(name)
            return torch.empty(0)
        return self.ckpt.shard(name, dim, rank, parts)


class ValueHead(torch.nn.Module):
    """A critic's output layer: one value per position (``hidden @ weight.T``), replicated on every
    tensor-parallel rank (each sees the whole hidden state, so their gradients agree). It takes megatron's
    output-layer call and ignores the shared embedding weight."""

    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
        self.sequence_parallel = False

    def forward(self, hidden_states: torch.Tensor, weight: object = None,
                runtime_gather_output: object = None) -> tuple[torch.Tensor, None]:  # megatron's call: ignored
        return hidden_states @ self.weight.t().to(hidden_states.dtype), None


class ModelRole:
    """One megatron model of this rank, built from a spec. Load its weights (`load_hf` or `load_from`),
    then either `start_training` (DDP, optimizer, scheduler) or `freeze` it."""

    def __init__(self, name: str, spec: ModelSpec, par: ParallelState, parallel: ParallelConfig, dtype: torch.dtype,
                 value_head: bool = False, routing_replay: bool = False, indexer_kl_coef: float = 0.0,
                 mtp_loss_coef: float = 0.0, qat: str | None = None):
        """`value_head`: a critic: the output layer is a scalar `ValueHead` (one value per position), the word
        embeddings are never tied to it, and the HF checkpoint's output layer is not loaded. `routing_replay`
        (models with experts): every forward routes tokens to the experts the engine routed them to (R3).
        `mtp_loss_coef` above 0: the checkpoint's multi-token-prediction layers are built and trained
        (`rlx.train.mtp`). `qat` (``int4``): the forward computes with the weights as an INT4 engine serves them
        (`rlx.train.qat`)."""
        self.name, self.spec, self.par, self.dtype = name, spec, par, dtype
        self.value_head = value_head
        if (par.ep > 1 or par.etp != par.tp) and not spec.num_experts:
            raise RLXError(f"train.parallel: ep={par.ep}, etp={par.etp} split experts, but the "
                           f"{spec.model_type!r} model has none; leave ep at 1 and etp unset")
        if spec.num_experts and spec.num_experts % par.ep:
            raise RLXError(f"train.parallel.ep: {par.ep} expert-parallel ranks cannot split the model's "
                           f"{spec.num_experts} experts evenly")
        if spec.num_experts:
            from rlx.train.megatron_patches.moe import expert_bias_with_padding, split_sequence_around_experts

            expert_bias_with_padding()  # rlx passes padding masks to the routers
            if par.tp > 1:
                split_sequence_around_experts()
        if mtp_loss_coef and not spec.mtp_layers:
            raise RLXError(f"train.objective.mtp_loss_coef: the {spec.model_type!r} checkpoint has no multi-token-"
                           f"prediction layers (num_nextn_predict_layers); leave it at 0")
        self.stage = stage_of(spec, par, spec.mtp_layers if mtp_loss_coef else 0)
        # megatron refuses variable lengths with the (MoE-only) allgather dispatcher, even for a dense model
        if routing_replay and not spec.num_experts:
            raise RLXError(f"train.objective.routing_replay: the {spec.model_type!r} model has no experts to route")
        replay: dict[str, Any] = {"moe_enable_routing_replay": True} if routing_replay else {}
        if indexer_kl_coef and getattr(spec, "dsa", None) is None:
            raise RLXError(f"train.objective.indexer_kl_coef: the {spec.model_type!r} model has no sparse-attention "
                           f"indexer to train; leave it at 0")
        if indexer_kl_coef:  # (`rlx.train.dsa`)
            replay["dsa_indexer_loss_coeff"] = indexer_kl_coef
        self.config = spec.transformer_config(parallel, dtype, calculate_per_token_loss=True,
                                              variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
                                              deterministic_mode=torch.are_deterministic_algorithms_enabled(),
                                              **replay)
        self.model = spec.build(self.config, self.stage)
        if qat is not None:
            from rlx.train.qat import fake_quantize_linears

            fake_quantize_linears(self.model)
        self.mtp = None
        if self.stage.mtp:
            from rlx.train.mtp import MTPTraining

            self.mtp = MTPTraining(self.model)
        if value_head:
            setattr(self.model, "share_embeddings_and_output_weights", False)  # every stage: no embedding-grad sync
            if self.stage.last:
                self.model.output_layer = ValueHead(self.config.hidden_size, dtype)
        if torch.cuda.is_available():
            self.model.cuda()
        self._keep: tuple[torch.Tensor, torch.Tensor] | None = None  # (columns, rows) the output layer computes
        if self.config.sequence_parallel or getattr(self.config, "mtp_num_layers", None):
            raise RLXError(f"{name}: sequence parallelism and multi-token prediction are not supported (the output "
                           f"layer computes only response positions of [sequence, batch] hidden states)")
        from rlx.train.attention import SDPACoreAttention

        # rlx's core attention takes packed rows' masks as block lengths; a bridge that builds its own spec with
        # another core attention (megatron's DotProductAttention, say) gets the dense [rows, 1, L, L] tensor
        cores = [m.core_attention for m in self.model.modules() if hasattr(m, "core_attention")]
        self._block_masks = all(isinstance(c, SDPACoreAttention) for c in cores)
        head = getattr(self.model, "output_layer", None) if self.stage.last else None
        self._selects = head is not None  # a bridge's own build() may have no megatron output layer
        if head is not None:
            head.register_forward_pre_hook(self._response_positions_only, with_kwargs=True)
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        self._positions: torch.Tensor | None = None  # [R, L] position of each packed token within its sample
        for m in self.model.modules():  # GPTModel's rotary, and each latent attention's own (plain or YaRN)
            if isinstance(m, RotaryEmbedding):
                m.register_forward_hook(self._rotary_at_positions)
        self.router_stats: Any = None  # per-layer routing statistics of the training forwards (models with experts)
        self.routing: Any = None  # the engine's routing, set on the routers micro-batch by micro-batch
        if spec.num_experts and not value_head:
            from rlx.train.moe import RouterStats, RoutingReplay

            topk = self.config.moe_router_topk
            self.router_stats = RouterStats(self.model, spec.num_layers, spec.num_experts, topk)
            self.routing = RoutingReplay(self.model, spec.num_layers, topk, routing_replay, spec.num_experts)
        self.trainable = False
        self.lora: dict[str, torch.nn.Module] = {}  # the projections with LoRA adapters, by module name
        self.lora_keys: list[str | None] = []  # the adapters they hold (None: the one adapter; multi-LoRA's names)
        self.adapter_params = 0  # the adapters' parameters (all ranks', each once)
        self.ddp: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None

    def start_training(self, optim: OptimConfig, total_updates: int, lora: LoRAConfig | None = None,
                       seed: int = 0) -> None:
        """Wrap the loaded model for training with `optim` (an ``OptimConfig``); with `lora`, low-rank adapters
        seeded from `seed` are what trains (`rlx.train.lora`)."""
        if lora is not None:
            from rlx.train.lora import adapter_params, attach

            local_experts = (self.spec.num_experts or 0) // self.par.ep
            self.lora = attach(self.model, lora, seed, self.stage.layer_offset, self.par.ep_rank * local_experts)
            self.lora_keys = lora.names
            p = self.par
            everyone: list[Any] = [None] * p.world  # the HF projections adapted on each stage
            dist.all_gather_object(everyone, {x for m in self.lora.values() for x in cast(Any, m).lora_parts})
            parts = sorted(set().union(*everyone))
            unmatched = sorted(set(lora.target_modules) - set(parts))
            if unmatched and "target_modules" in lora.model_fields_set:  # (the default: those the model has)
                raise RLXError(f"train.lora.target_modules: {', '.join(unmatched)} name no projection of this model "
                               f"(those it has of the targets: {', '.join(parts)})")
            self.adapter_params = adapter_params(self.model, p.world, p.tp, p.dp, p.pp, p.ep, p.etp)
            if p.rank == 0:  # (with Ray in the trainer's log; `lora/params` in the metrics)
                print(f"rlx: LoRA on {len(self.lora)} projections of rank 0 ({', '.join(parts)}): "
                      f"{self.adapter_params:,} adapter parameters trained", file=sys.stderr, flush=True)
        self.ddp, self.optimizer, self.scheduler = self._wrap(optim, total_updates)
        self.trainable = True

    def freeze(self) -> None:
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    # -- weights in ------------------------------------------------------------------------------

    def load_hf(self, folder: str | Path) -> None:
        """Copy this rank's tensors from the HF checkpoint at `folder` into the model, one tensor at a time. A critic
        takes everything but the output layer; its value head starts from the checkpoint's ``score.weight``
        (``[1, hidden]``, as a transformers sequence-classification model with one label stores it) when
        there is one, else from zero (every value 0 at the start)."""
        ckpt = self.spec.read(folder)
        if self.value_head:  # a reward model's checkpoint has no LM head: the bridge must not need to read one
            optional = _LMHeadOptional(ckpt)  # it has what bridges call: in, get, shard, folder
            named = self._with_value_head(self.spec.to_megatron(cast(HFCheckpoint, optional), self.stage), optional)
        else:
            named = self.spec.to_megatron(ckpt, self.stage)
        self._copy_in(named, f"model bridge for {self.spec.model_type!r}")

    def _with_value_head(self, named: Iterable[tuple[str, torch.Tensor]],
                         ckpt: _LMHeadOptional) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named:
            if name.startswith("output_layer."):
                ckpt.missing.clear()  # what it lacked was the LM head's
                continue
            if ckpt.missing:  # a tensor other than the LM head was read but is not in the checkpoint
                raise RLXError(f"train.critic.model_path: the checkpoint in {ckpt.folder} has no tensor "
                               f"{ckpt.missing[0]!r}")
            yield name, t
        if self.stage.last:
            hidden = self.config.hidden_size
            head = ckpt.get("score.weight") if "score.weight" in ckpt else torch.zeros(1, hidden)
            if tuple(head.shape) != (1, hidden):
                raise RLXError(f"{ckpt.folder}: score.weight has shape {tuple(head.shape)}; a critic's value head "
                               f"is [1, {hidden}]")
            yield "output_layer.weight", head

    def load_from(self, other: ModelRole) -> None:
        """Start from another role's current weights (same spec and layout), without reading the checkpoint (the
        reference does not take the actor's trained multi-token-prediction layers)."""
        named = [(k, v) for k, v in self._local_state(other.model).items()
                 if self.mtp is not None or not k.startswith("mtp.")]
        self._copy_in(named, f"role {other.name!r}")

    def _copy_in(self, named: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        if self.trainable:
            raise RLXError(f"{self.name}: weights are loaded before start_training, not after")
        state = self._local_state(self.model)
        seen = set()
        with torch.no_grad():
            for name, t in named:
                if name not in state:
                    raise RLXError(f"{source} produced {name!r}, which the {self.name} model does not have")
                if tuple(t.shape) != tuple(state[name].shape):
                    raise RLXError(f"{source}: {name!r} has shape {tuple(t.shape)}, the {self.name} model "
                                   f"expects {tuple(state[name].shape)}")
                state[name].copy_(t)
                seen.add(name)
        missing = [k for k in state if k not in seen]
        if missing:
            raise RLXError(f"{source} left weights of the {self.name} model unset: {missing[:5]}")

    @staticmethod
    def _local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}

    def _wrap(self, optim: OptimConfig, total_updates: int) -> tuple[Any, Any, Any]:  # megatron's DDP, optimizer, LR
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from rlx.train.megatron_patches.ddp import skip_lone_collectives

        o = optim
        ddp = DistributedDataParallel(self.config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                                  grad_reduce_in_fp32=True),
                                      self.model)
        skip_lone_collectives(ddp)
        opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, use_distributed_optimizer=True,
            bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype), [ddp])
        sched = OptimizerParamScheduler(opt, init_lr=0.0 if o.lr_warmup_steps else o.lr, max_lr=o.lr,
                                        min_lr=o.min_lr, lr_warmup_steps=o.lr_warmup_steps,
                                        lr_decay_steps=max(total_updates, o.lr_warmup_steps + 1),
                                        lr_decay_style=o.lr_decay, start_wd=o.weight_decay,
                                        end_wd=o.weight_decay, wd_incr_steps=max(total_updates, 1),
                                        wd_incr_style="constant")
        return ddp, opt, sched

    # -- forward / backward ----------------------------------------------------------------------

    def _response_positions_only(self, module: torch.nn.Module, args: tuple[Any, ...],
                                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The output layer (LM head or value head) runs on the hidden states of the positions whose outputs are
        used (those predicting response tokens), not on every packed position: prompts and row padding cost no
        vocabulary-wide matmul, softmax or copy. megatron's hidden states are ``[L, R, H]`` (sequence first); the
        kept ones go in as ``[T, 1, H]``, in `PackedBatch.response_positions` order, and come out ``[1, T, V]``."""
        if self._keep is None:
            return None
        cols, rows = self._keep
        return (args[0][cols, rows].unsqueeze(1), *args[1:]), kwargs

    def _rotary_at_positions(self, module: torch.nn.Module, args: tuple[Any, ...],
                             out: torch.Tensor) -> torch.Tensor | None:
        """megatron rotates the token at row position ``p`` by angles for ``p``: the rotary table ``[L, 1, 1, D]``
        for positions 0..L-1. In a packed row each sample's tokens are rotated for their place in the sample
        instead (`PackedBatch.position_ids`), as the engine rotates them: ``[L, R, 1, D]``. Attention scores
        depend only on the distance between positions, but the angles of positions deep in a long row carry
        more rounding than the engine's, so the trainer's log-probs would drift from the engine's with the
        row's length. YaRN's table comes with its attention scale, ``(table, mscale)``."""
        if self._positions is None:
            return None
        table = out[0] if isinstance(out, tuple) else out
        picked = table[:, 0, 0][self._positions.t()].unsqueeze(2)
        return (picked, *out[1:]) if isinstance(out, tuple) else picked

    def schedule(self, batches: list[PackedBatch], loss_fn: Callable[[PackedBatch, torch.Tensor], Any],
                 forward_only: bool) -> list[Any]:
        """Run megatron's forward(-backward) schedule over packed micro-batches.

        ``loss_fn(mb, logits)`` runs on the last stage only and returns ``(loss, metrics)``, or, when
        ``forward_only``, any data to collect. Returns what the last stage collected ([] elsewhere).
        """
        if not batches:
            return []
        dev = device()
        model = self.ddp if (self.trainable and not forward_only) else self.model

        def forward_step(data_iterator, m):
            mb = next(data_iterator)
            if len(self.lora_keys) > 1:  # multi-LoRA: a micro-batch is one adapter's (`RLStep.packed`)
                select(self.lora, mb.samples[0].lora)
            extra = {}
            if self.spec.num_experts:  # pads stay out of the routers' statistics and expert-bias counts
                pads = mb.pad_mask.clone()
                if self.routing is not None:
                    unrouted = self.routing.set(mb)
                    if unrouted is not None:  # replayed with placeholder experts: not counted either
                        pads |= unrouted
                extra["padding_mask"] = pads.to(dev)
            if self._selects:
                width = mb.input_ids.shape[1]
                pos = mb.response_positions.to(dev)
                self._keep = (pos % width, pos // width)
            positions = mb.position_ids.to(dev)
            self._positions = positions
            ids = mb.input_ids.to(dev)
            if self.mtp is not None and not forward_only:
                self.mtp.batch = (mb, ids, positions)
            try:
                mask = mb.attention_mask if self._block_masks else mb.attention_mask.dense()
                out = m(ids, positions, attention_mask=mask.to(dev), **extra)
            finally:
                self._keep = None
                self._positions = None
                if self.mtp is not None:
                    self.mtp.batch = None
            mb.outputs_at_response = self._selects

            def reduce(logits, non_loss_data=False):
                if non_loss_data:
                    return loss_fn(mb, logits)
                loss, metrics = loss_fn(mb, logits)
                return loss, torch.tensor(1, dtype=torch.int), metrics

            return out, reduce

        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                num_microbatches=len(batches), seq_length=max(b.input_ids.shape[1] for b in batches),
                micro_batch_size=1, forward_only=forward_only, collect_non_loss_data=forward_only)
        finally:
            if self.routing is not None:
                self.routing.clear()

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> float:
        """Finish the gradient reduction and step; returns the gradient norm."""
        # Not just ddp.finish_grad_sync(): q/k layernorm weights are replicated over tensor-parallel
        # ranks but each rank only sees its own heads, so their gradients must also be summed over TP.
        finalize_model_grads([self.ddp])
        if self.spec.num_experts and self.par.tp > 1:  # each tensor-parallel rank routed part of the tokens
            sum_router_grads(self.ddp, ps.get_tensor_model_parallel_group())
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RLXError(f"{self.name}: the optimizer step failed (non-finite gradients)")
        self.scheduler.step(increment=1)
        return float(grad_norm or 0.0)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # -- weights out -----------------------------------------------------------------------------

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's full HF tensors, one at a time (collective over the stage's tensor-parallel group, and
        with experts split over ranks its expert-parallel groups: every rank with `ParallelState.gathers`
        must iterate to the end)."""
        state = self._local_state(self.model)
        if self.lora_keys == [None]:  # (`rlx.train.lora`): the weights the adapter makes, each when it is gathered
            from rlx.train.lora import Merged

            state = Merged(state, self.lora)
        yield from self.hf_of(state)

    def hf_of(self, state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """`hf_tensors` of the tensors `state` holds under this model's names (its own, some replaced)."""
        par = self.par

        def over(t: torch.Tensor, size: int, group: ProcessGroup | None) -> list[torch.Tensor]:
            if size == 1:
                return [t]
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=group)
            return parts

        class _Gather:
            def __call__(self, name: str) -> list[torch.Tensor]:
                return over(state[name].detach(), par.tp, ps.get_tensor_model_parallel_group())

            def experts(self, name: str) -> list[list[torch.Tensor]]:
                mine = over(state[name].detach(), par.etp, ps.get_expert_tensor_parallel_group())
                each = [over(t, par.ep, ps.get_expert_model_parallel_group()) for t in mine]  # [etp][ep]
                return [[each[r][e] for r in range(par.etp)] for e in range(par.ep)]

        yield from self.spec.hf_tensors(self.stage, _Gather())

    # -- checkpoint ------------------------------------------------------------------------------

    def _inner_optimizers(self) -> list:
        """The torch optimizers over this rank's shard of main parameters, inside megatron's wrappers."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [o.optimizer for o in chained]

    def _layout(self) -> dict[str, int]:
        p = self.par
        return {"tp": p.tp, "pp": p.pp, "dp": p.dp, "ep": p.ep, "etp": p.etp}

    def _sharded_state(self, loading: bool = False) -> dict[str, Any]:
        """The model (and the optimizer's state) as megatron's sharded tensors: each a slice of one global tensor,
        however the ranks split it, so that a checkpoint written under one layout loads under another."""
        checkpoint_patches.install()
        model = cast(Any, self.model).sharded_state_dict()  # (a megatron module)
        if not self.trainable:
            return {"model": model}
        if loading:  # megatron loads into the optimizer's state, which torch's Adam creates at its first step
            for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                if not o.optimizer.state:
                    o._init_optimizer_states_with_dummy_values()  # (the weights it moves are loaded over)
        return {"model": model, "optimizer": self.optimizer.sharded_state_dict(
            model, is_loading=loading, metadata={"distrib_optim_sharding_type": "fully_reshardable",
                                                 "chained_optim_avoid_prefix": True})}

    def save(self, folder: Path, writes: checkpoint_patches.BackgroundWrites | None = None) -> None:
        """The model and the optimizer's state into `folder`/<role> in megatron's reshardable format (torch_dist,
        `megatron.core.dist_checkpointing`), with the LR schedule and this rank's random state beside it. With
        `writes`, the tensors are copied now and written by `writes` (the checkpoint is whole once it finishes)."""
        d = folder / self.name
        d.mkdir(parents=True, exist_ok=True)
        dist.barrier()  # the folder exists for every rank
        if writes is None:
            dist_checkpointing.save(self._sharded_state(), str(d))
        else:
            request = dist_checkpointing.save(self._sharded_state(), str(d), async_sharded_save=True)
            assert request is not None, "an asynchronous save returns its request"
            writes.add(request)
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                   d / f"rng_rank{self.par.rank}.pt")
        if self.par.rank == 0:
            torch.save(self._layout(), d / "layout.pt")
            if self.trainable:
                torch.save({"scheduler": self.scheduler.state_dict()}, d / "scheduler.pt")
        dist.barrier()

    def load(self, folder: Path) -> None:
        """What `save` wrote, under this run's layout whatever the saving run's was (TP, PP, EP, DP). A run's random
        state comes back only under the layout that saved it (each rank's is its own)."""
        d = folder / self.name
        if not (d / "metadata.json").exists():
            old = "written per rank by rlx before checkpoints reshard" if any(d.glob("model_tp*.pt")) else "absent"
            raise RLXError(f"--resume: the {self.name} checkpoint in {folder} is {old}: start the run again "
                           f"(or resume it with the rlx that wrote it)")
        layout = torch.load(d / "layout.pt", weights_only=False)
        template = self._sharded_state(loading=True)
        loaded = dist_checkpointing.load(template, str(d))
        self.model.load_state_dict(loaded["model"], strict=False)
        if not self.trainable:
            return
        # megatron keeps the experts' parameters in an optimizer of their own when ep > 1: between ep = 1 and ep > 1
        # the saved parameter groups are regrouped as this run's optimizer holds them (the state tensors load by name)
        parts = len(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))
        saved = dist_checkpointing.load_common_state_dict(str(d))["optimizer"]
        self.optimizer.load_state_dict(checkpoint_patches.regrouped(saved, loaded["optimizer"], template["optimizer"],
                                                                    parts))
        self.scheduler.load_state_dict(torch.load(d / "scheduler.pt", weights_only=False)["scheduler"])
        if layout == self._layout():
            rng = torch.load(d / f"rng_rank{self.par.rank}.pt", weights_only=False)
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            if rng["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])

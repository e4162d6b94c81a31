"""One trainer rank: the model roles, the RL step, and the weights that leave for the engines.

The same code on CPU (gloo) and GPU (NCCL). The model comes from the bridge registered for the
checkpoint's ``model_type``; the actor loads the HF checkpoint (each rank reading its own slice), the
reference model (only when ``train.objective.kl_coef > 0``) starts from the actor's weights in memory (with
``train.lora`` it is the actor with its adapters off: no second copy).
Weight pushes and HF export stream the actor's tensors stage by stage: only one rank per pipeline
stage (data-parallel rank 0, tensor-parallel rank 0) sends, after its tensor-parallel group gathers
each tensor in turn.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from rlx.config import Config, trainer_offloads
from rlx.errors import RLXError
from rlx.models.tiny import resolve_model_path
from rlx.train.kernel_choice import matmul_choice, use_matmul
from rlx.train.lora import AdaptersOff
from rlx.train.model import ModelRole, ParallelState, device, init_distributed, torch_dtype
from rlx.train.offload import Residency
from rlx.train.ppo import CriticStep, check_critic_model
from rlx.train.spec import model_spec
from rlx.train.step import RLStep, loss_norm, prepare
from rlx.types import RolloutBatch

if TYPE_CHECKING:
    from rlx.plugins import Plugins
    from rlx.protocols import CriticEstimator
    from rlx.train.megatron_patches.checkpoint import BackgroundWrites


class Trainer:
    def __init__(self, cfg: Config, plugins: Plugins, master_addr: str = "127.0.0.1"):
        tc = cfg.train
        self.cfg, self.tc = cfg, tc
        self.par: ParallelState = init_distributed(tc.parallel, cfg.run.seed, master_addr,
                                                   deterministic=cfg.run.deterministic)
        self.model_path = resolve_model_path(cfg.model.path)
        self.spec = model_spec(self.model_path, plugins, cfg.model.kernels)
        dtype = torch_dtype(cfg.model.dtype)
        use_matmul(plugins, matmul_choice(cfg.model.kernels), device(), dtype, self.spec.hidden_size)
        replay = tc.objective.routing_replay
        self.actor = ModelRole("actor", self.spec, self.par, tc.parallel, dtype, routing_replay=replay,
                               indexer_kl_coef=tc.objective.indexer_kl_coef, mtp_loss_coef=tc.objective.mtp_loss_coef,
                               qat=tc.qat)
        self.actor.load_hf(self.model_path)
        self.reference: ModelRole | AdaptersOff | None = None
        if tc.objective.kl_coef > 0 and tc.lora is None:
            self.reference = ModelRole("reference", self.spec, self.par, tc.parallel, dtype, routing_replay=replay,
                                       qat=tc.qat)
            self.reference.load_from(self.actor)
            self.reference.freeze()
        self.actor.start_training(tc.optim, tc.num_steps * tc.updates_per_step, tc.lora, cfg.run.seed)
        if tc.objective.kl_coef > 0 and tc.lora is not None:  # the frozen model is the actor with its adapters off
            self.reference = AdaptersOff(self.actor)
        self.estimator = plugins.build("advantages", tc.objective.advantage)
        policy_loss = plugins.build("losses", tc.objective.loss)
        self.loss_norm = loss_norm(tc.objective, policy_loss)
        self.step_fn = RLStep(tc, policy_loss, plugins.build("balancers", tc.balancer), self.spec.flops, self.par)
        self.critic: ModelRole | None = None
        self.critic_step: CriticStep | None = None
        critic_estimator = cast("CriticEstimator", self.estimator)  # read only where needs_critic says it is one
        if getattr(self.estimator, "needs_critic", False) and tc.critic.parallel is not None:
            # the critic has ranks of its own (CriticTrainer): this side makes advantages and trains the actor
            self.critic_step = CriticStep(tc, critic_estimator, self.step_fn, None, self.loss_norm)
        elif getattr(self.estimator, "needs_critic", False):
            self.critic = ModelRole("critic", self.spec, self.par, tc.parallel, dtype, value_head=True)
            critic_path = resolve_model_path(tc.critic.model_path) if tc.critic.model_path else self.model_path
            if critic_path != self.model_path:
                check_critic_model(model_spec(critic_path, plugins), self.spec, critic_path)
            self.critic.load_hf(critic_path)
            self.critic.start_training(tc.critic.optim, tc.num_steps * tc.updates_per_step)
            self.critic_step = CriticStep(tc, critic_estimator, self.step_fn, self.critic, self.loss_norm)
        self.step = 0
        copy = self.reference if isinstance(self.reference, ModelRole) else None  # (a reference of its own)
        self.memory = Residency(trainer_offloads(cfg), {"actor": self.actor, "reference": copy, "critic": self.critic},
                                device())
        self.memory.hold()  # the engines' turn first: they size their cache by the memory they find

    def train_step(self, batch: RolloutBatch) -> dict[str, float | None]:
        """Train on every trainable sample of the batch; returns global metrics."""
        if self.critic_step is not None and self.critic is None:
            raise RLXError("the critic has ranks of its own (train.critic.parallel): the trainer group runs the "
                           "step (the critic's values, train_actor, the critic's update)")
        metrics: dict[str, float | None]
        if self.critic_step is not None:
            metrics = self.critic_step.run(batch, self.actor, self.reference, self.step, self._hold_actor,
                                           lambda: self.memory.hold(critic="all"))
        else:
            tb = prepare(batch, self.estimator, self.loss_norm, self.step_fn.multi)
            self._hold_actor()
            metrics = self.step_fn.run(tb, self.actor, self.reference)
        self.memory.hold()
        self.step += 1
        return metrics

    def _hold_actor(self) -> None:
        self.memory.hold(actor="all", **({"reference": "weights"} if isinstance(self.reference, ModelRole) else {}))

    def train_actor(self, batch: RolloutBatch,
                    values: dict[int, torch.Tensor]) -> tuple[dict[str, float | None], dict[int, torch.Tensor]]:
        """With a critic in ranks of its own: the actor's half of the step from the critic's `values` (advantages,
        then the actor's update, none during the critic's warm-up); returns its metrics and the critic's targets."""
        if self.critic_step is None:
            raise RLXError("train_actor: this run's advantage estimator uses no critic")
        self._hold_actor()
        tb = self.critic_step.prepare(batch, self.actor, self.reference, values)
        metrics = self.critic_step.train_actor(tb, self.actor, self.reference, self.step)
        self.memory.hold()  # the critic's ranks train next (on the same GPUs when they share them)
        self.step += 1
        assert tb.returns is not None  # prepare() with values sets them
        return metrics, tb.returns

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's HF tensors of this rank's pipeline stage, one at a time. Every rank of the stage's
        tensor-parallel group must drain it (gathers are collective); ranks of other data-parallel
        replicas need not, unless experts are split over ranks (every rank with ``par.gathers`` drains it)."""
        self.memory.hold(actor="weights")
        try:
            yield from self.actor.hf_tensors()
        finally:
            self.memory.hold()

    def adapts_experts(self) -> bool:
        """Whether ``train.lora`` put adapters on routed experts (on any stage; collective over every rank)."""
        import torch.distributed as dist

        from rlx.train.lora import EXPERT

        experts = torch.tensor([float(any(EXPERT.search(name) for name in self.actor.lora))])
        dist.all_reduce(experts, op=dist.ReduceOp.MAX)
        return bool(experts.item())

    def adapter_tensors(self, key: str | None = None) -> dict[str, torch.Tensor] | None:
        """The actor's LoRA adapter `key` (None: the one adapter; multi-LoRA's by name) whole, by peft's names for the
        transformers model
        (``base_model.model.<module>.lora_A.weight``, ``lora_B``; fused parts share their A), on CPU: on rank 0, None
        elsewhere. What an adapter push sends and ``--save-hf`` writes. Collective over every rank."""
        import torch.distributed as dist

        from rlx.train.lora import adapters
        from rlx.transport.sender import agree

        assert self.tc.lora is not None
        targets, mine = self.tc.lora.target_modules, {}

        def collect() -> None:
            self.memory.hold(actor="weights")  # (colocated offload: the adapters are with the weights)
            try:
                for module, a, b in adapters(self.actor, targets, key):
                    if self.par.sender:
                        mine[f"base_model.model.{module}.lora_A.weight"] = a.cpu().clone()
                        mine[f"base_model.model.{module}.lora_B.weight"] = b.cpu().clone()
            finally:
                self.memory.hold()

        agree(self.par, collect)
        parts: list[Any] = [None] * self.par.world if self.par.rank == 0 else []
        dist.gather_object(mine, parts if self.par.rank == 0 else None, dst=0)
        return dict(sorted((k, v) for p in parts for k, v in p.items())) if self.par.rank == 0 else None

    def adapter_config(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """peft's ``adapter_config`` of the adapters `tensors` holds (`adapter_tensors`)."""
        lora = self.tc.lora
        assert lora is not None
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(self.model_path),
                "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
                "target_modules": sorted({m.rsplit(".", 3)[-3] for m in tensors}), "bias": "none",
                "fan_in_fan_out": False, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
                "inference_mode": True}

    def save(self, folder: Path, writes: BackgroundWrites | None = None) -> None:
        """Every trained role's checkpoint into `folder` (`ModelRole.save`; with `writes`, written in the
        background)."""
        import torch.distributed as dist

        for role in self.trained_roles():
            self.memory.hold(**{role.name: "all"})
            role.save(folder, writes)
        self.memory.hold()
        if self.par.rank == 0:
            torch.save({"step": self.step}, folder / "trainer.pt")
        dist.barrier()

    def load(self, folder: Path) -> None:
        for role in self.trained_roles():
            self.memory.hold(**{role.name: "all"})
            role.load(folder)
        self.memory.hold()
        self.step = torch.load(folder / "trainer.pt", weights_only=False)["step"]

    def trained_roles(self) -> list[ModelRole]:
        """The roles whose weights change, and so go into checkpoints (the actor, and the critic when there is
        one). The reference model is not saved: it is the initial policy, which a resumed run rebuilds from the
        checkpoint it started from."""
        return [self.actor] + ([self.critic] if self.critic is not None else [])

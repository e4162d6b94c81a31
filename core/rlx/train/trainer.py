"""The Megatron trainer: one instance per rank, the same code on CPU (gloo) and GPU (NCCL).

Choices:

* The model is megatron-core's GPTModel with the local layer spec, built from an HF checkpoint by a
  model bridge (`register_models`), wrapped in megatron's DDP with the DistributedOptimizer. On CPU
  `rlx.train.megatron_cpu` redirects the CUDA-only calls first; fp32 on CPU, bf16 on GPU.
* A step: advantages from the estimator, per-token loss weights for the whole global batch, samples
  split across data-parallel ranks by the balancer, packed into micro-batches bounded by tokens,
  forward/backward through megatron's own schedule (``get_forward_backward_func``: no pipelining, or
  1F1B across pipeline stages with ``variable_seq_lengths`` so packed micro-batches may differ in
  shape), gradients accumulated in megatron's buffers, one optimizer step per mini-batch
  (``updates_per_step``). Because the weights already normalise over the global batch,
  gradients are summed over ranks, not averaged (``calculate_per_token_loss``).
* Old log-probs: with one update per step they equal the current ones (the ratio is exactly 1 at the
  start), so no extra forward pass; with more updates they are computed before the first one.
  Reference log-probs come from a frozen copy of the initial model, only when ``kl_coef > 0``.
* Pipeline parallelism: every rank of a stage holds the whole batch and cuts the same micro-batches, so
  all stages agree on their number and order; only the last stage computes losses and log-probs.
* Metrics are global: sums over data-parallel ranks.
"""

from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass
from typing import Any

import torch

from rlx.config import Config
from rlx.errors import RLXError
from rlx.models.tiny import resolve_model_path
from rlx.rollout.rewards import instantiate
from rlx.train.balance import FlopsModel, micro_batches
from rlx.train.bridge import ModelShape
from rlx.train.losses import token_weights
from rlx.train.objective import LossInputs, ObjectiveConfig, metric_keys, objective
from rlx.train.packing import PackedBatch, pack, per_token
from rlx.types import RolloutBatch, Sample


@dataclass
class ParallelState:
    rank: int
    world: int
    tp: int
    pp: int
    dp: int
    dp_rank: int
    tp_rank: int
    pp_rank: int = 0

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def init_distributed(cfg: Config) -> ParallelState:
    """Join (or create, for one process) the default process group and megatron's model-parallel groups."""
    import torch.distributed as dist

    from rlx.train import megatron_cpu

    megatron_cpu.enable()
    tc = cfg.train
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            from rlx.rollout.engines.launch import free_port

            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    world = dist.get_world_size()
    if world != tc.world_size:
        raise RLXError(f"train.world_size is {tc.world_size} but {world} trainer processes are running")
    if world % (tc.tp * tc.pp):
        raise RLXError(f"train.world_size {world} is not a multiple of tp*pp = {tc.tp * tc.pp}")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tc.tp, tc.pp)
    model_parallel_cuda_manual_seed(cfg.run.seed)
    return ParallelState(dist.get_rank(), world, tc.tp, tc.pp, ps.get_data_parallel_world_size(),
                         ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                         ps.get_pipeline_model_parallel_rank())


class MegatronTrainer:
    def __init__(self, cfg: Config, plugins: Any):
        from transformers import AutoConfig

        self.cfg = cfg
        self.tc = cfg.train
        self.par = init_distributed(cfg)
        self.dtype = self._dtype()
        self.model_path = resolve_model_path(cfg.model.path)
        hf_config = AutoConfig.from_pretrained(self.model_path)
        self.shape = ModelShape.from_hf(hf_config)
        if self.shape.layers % self.tc.pp:
            raise RLXError(f"train.pp: {self.tc.pp} pipeline stages cannot split the model's "
                           f"{self.shape.layers} layers evenly")
        self.bridge = self._bridge(plugins)
        self.flops = FlopsModel.from_shape(self.shape.hidden, self.shape.layers, self.shape.ffn,
                                           self.shape.vocab_size, self.shape.kv_heads, self.shape.heads)
        self.estimator = instantiate(plugins.get("losses", self.tc.advantage.name), self.tc.advantage.args)
        self.policy_loss = instantiate(plugins.get("losses", self.tc.loss.name), self.tc.loss.args)
        self.balancer = instantiate(plugins.get("balancers", self.tc.balancer.name), self.tc.balancer.args)
        self.objective_cfg = ObjectiveConfig(self.tc.kl_coef, self.tc.kl_type, self.tc.entropy_coef, self.tc.tis_cap,
                                             self.tc.tis_mode)
        hf_state = self._load_hf_state()
        self.model = self._build(hf_state)
        self.ref_model = self._build(hf_state, frozen=True) if self.tc.kl_coef > 0 else None
        del hf_state
        self.ddp, self.optimizer, self.scheduler = self._wrap(self.model)
        self.step = 0

    # -- construction ----------------------------------------------------------------------------

    def _dtype(self) -> torch.dtype:
        d = self.cfg.model.dtype
        if d == "auto":
            return torch.bfloat16 if torch.cuda.is_available() else torch.float32
        return getattr(torch, d)

    def _bridge(self, plugins: Any) -> Any:
        for name in plugins.names("models"):
            comp = plugins.get("models", name)
            if self.shape.model_type in getattr(comp, "model_types", ()):
                return comp() if isinstance(comp, type) else comp
        raise RLXError(f"model.path: no model bridge for model_type {self.shape.model_type!r}; "
                       f"install a model plugin that supports it (`rl plugins` lists bridges under models)")

    def _load_hf_state(self) -> dict[str, torch.Tensor]:
        from pathlib import Path

        from safetensors.torch import load_file

        files = sorted(Path(self.model_path).glob("*.safetensors"))
        if not files:
            raise RLXError(f"model.path: no *.safetensors in {self.model_path}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state

    def _build(self, hf_state: dict[str, torch.Tensor], frozen: bool = False):
        from megatron.core.models.gpt import GPTModel

        s = self.shape
        config = self.bridge.transformer_config(s, tp=self.tc.tp, pp=self.tc.pp, dtype=self.dtype,
                                                calculate_per_token_loss=True, variable_seq_lengths=True,
                                                # megatron refuses variable lengths with the (MoE-only)
                                                # allgather dispatcher, even for a dense model
                                                moe_token_dispatcher_type="alltoall")
        self.transformer_config = config
        model = GPTModel(config, self.bridge.layer_spec(s), vocab_size=s.vocab_size,
                         max_sequence_length=s.max_positions, position_embedding_type="rope",
                         rotary_base=s.rope_theta, share_embeddings_and_output_weights=s.tied,
                         pre_process=self.par.first_stage, post_process=self.par.last_stage)
        sd = self.bridge.to_megatron(hf_state, s, tp_rank=self.par.tp_rank, tp=self.tc.tp, **self._stage())
        sd = {k: v.to(self.dtype) for k, v in sd.items()}
        model.load_state_dict(sd, strict=False)
        missing = [k for k in model.state_dict() if k not in sd and not k.endswith("_extra_state")]
        if missing:
            raise RLXError(f"model bridge {self.bridge.name!r} left weights unset: {missing[:5]}")
        if torch.cuda.is_available():
            model.cuda()
        if frozen:
            model.eval()
            for p in model.parameters():
                p.requires_grad_(False)
        return model

    def _stage(self) -> dict[str, Any]:
        """Which layers this pipeline stage holds, in the bridge's terms."""
        n = self.shape.layers // self.tc.pp
        return {"layer_offset": self.par.pp_rank * n, "num_layers": n, "first": self.par.first_stage,
                "last": self.par.last_stage}

    def _wrap(self, model):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        tc = self.tc
        ddp = DistributedDataParallel(self.transformer_config,
                                      DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                    grad_reduce_in_fp32=True), model)
        opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=tc.lr, min_lr=tc.min_lr, weight_decay=tc.weight_decay, adam_beta1=tc.adam_beta1,
            adam_beta2=tc.adam_beta2, adam_eps=tc.adam_eps, clip_grad=tc.clip_grad, use_distributed_optimizer=True,
            bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype), [ddp])
        total = tc.num_steps * tc.updates_per_step
        sched = OptimizerParamScheduler(opt, init_lr=0.0 if tc.lr_warmup_steps else tc.lr, max_lr=tc.lr,
                                        min_lr=tc.min_lr, lr_warmup_steps=tc.lr_warmup_steps,
                                        lr_decay_steps=max(total, tc.lr_warmup_steps + 1),
                                        lr_decay_style=tc.lr_decay, start_wd=tc.weight_decay,
                                        end_wd=tc.weight_decay, wd_incr_steps=max(total, 1), wd_incr_style="constant")
        return ddp, opt, sched

    # -- log-probs -------------------------------------------------------------------------------

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _schedule(self, model, batches: list[PackedBatch], loss_fn, forward_only: bool) -> list[Any]:
        """Run megatron's forward(-backward) schedule over packed micro-batches.

        ``loss_fn(mb, logits)`` runs on the last stage only and returns ``(loss, metrics)``, or, when
        ``forward_only``, any data to collect. Returns what the last stage collected ([] elsewhere).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        dev = self._device()
        it = iter(batches)

        def forward_step(data_iterator, m):
            mb = next(data_iterator)
            out = m(mb.input_ids.to(dev), mb.position_ids.to(dev), attention_mask=mb.attention_mask.to(dev))

            def reduce(logits, non_loss_data=False):
                if non_loss_data:
                    return loss_fn(mb, logits)
                loss, metrics = loss_fn(mb, logits)
                return loss, torch.tensor(1, dtype=torch.int), metrics

            return out, reduce

        if not batches:
            return []
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=it, model=[model], num_microbatches=len(batches),
            seq_length=max(b.input_ids.shape[1] for b in batches), micro_batch_size=1,
            forward_only=forward_only, collect_non_loss_data=forward_only)

    def _response_logprobs(self, mb: PackedBatch, logits: torch.Tensor, entropy: bool):
        """Log-probs of the response tokens (and their entropy) from the last stage's logits, vocab-parallel safe."""
        from megatron.core import tensor_parallel

        dev = logits.device
        pos = mb.response_positions.to(dev)
        resp_logits = logits.reshape(-1, logits.shape[-1])[pos].float()  # [T, V/tp]
        targets = mb.targets.to(dev)[pos]
        logprobs = -tensor_parallel.vocab_parallel_cross_entropy(resp_logits[:, None, :].contiguous(),
                                                                 targets[:, None])[:, 0]
        ent = vocab_parallel_entropy(resp_logits) if entropy else None
        return logprobs, ent

    def _packed(self, samples: list[Sample]) -> list[PackedBatch]:
        return [pack([samples[i] for i in idx], self.tc.row_tokens)
                for idx in micro_batches([s.total_len for s in samples], self.tc.max_tokens_per_micro_batch)]

    @torch.no_grad()
    def logprobs(self, samples: list[Sample], model=None) -> dict[int, list[float]]:
        """Per-token log-probs of each sample's response under `model` (default: the policy).

        Only the last pipeline stage has logits, and only it computes losses: other stages get {}.
        """
        model = model or self.model

        def collect(mb: PackedBatch, logits: torch.Tensor):
            lp = self._response_logprobs(mb, logits, entropy=False)[0].cpu().tolist()
            out, start = {}, 0
            for s in mb.samples:
                out[s.sample_id] = lp[start:start + len(s.response_ids)]
                start += len(s.response_ids)
            return out

        out: dict[int, list[float]] = {}
        for part in self._schedule(model, self._packed(samples), collect, forward_only=True):
            out.update(part)
        return out

    # -- one training step -----------------------------------------------------------------------

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """Train on every trainable sample of the batch; returns global metrics."""
        import torch.distributed as dist
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        groups = [g for g in batch.groups if g.trainable]
        adv = self.estimator.advantages(groups)
        groups = [g for g in groups if any(s.sample_id in adv for s in g.trainable)]
        samples = [s for g in groups for s in g.trainable if s.sample_id in adv]
        if not samples:
            raise RLXError(f"step {batch.step}: no trainable samples (all failed or filtered)")
        weights = token_weights(groups, self.tc.loss_norm)
        # Mini-batches are cut from the global batch, then each is split over data-parallel ranks, so
        # every update sees the same samples whatever the number of ranks.
        updates = self.tc.updates_per_step
        minis = [self._my_share(samples[i::updates]) for i in range(updates)]
        mine = [s for m in minis for s in m]
        ref = self.logprobs(mine, self.ref_model) if self.ref_model is not None else None
        old = self.logprobs(mine) if updates > 1 else None

        # Every rank reduces the same keys, whether or not its stage computes losses.
        keys = [*metric_keys(kl=ref is not None, entropy=True), "grad_norm"]
        totals = dict.fromkeys(keys, 0.0)
        for mini in minis:
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            loss_fn = functools.partial(self._micro_loss, adv=adv, weights=weights, old=old, ref=ref)
            for m in self._schedule(self.ddp, self._packed(mini), loss_fn, forward_only=False):
                for k, v in m.items():
                    totals[k] += v
            # Not just ddp.finish_grad_sync(): q/k layernorm weights are replicated over tensor-parallel
            # ranks but each rank only sees its own heads, so their gradients must also be summed over TP.
            finalize_model_grads([self.ddp])
            ok, grad_norm, _ = self.optimizer.step()
            if not ok:
                raise RLXError(f"step {batch.step}: the optimizer step failed (non-finite gradients)")
            self.scheduler.step(increment=1)
            totals["grad_norm"] += float(grad_norm or 0.0) / self.par.world
        self.step += 1

        t = torch.tensor([totals[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t)  # sum over ranks; TP ranks repeat the same numbers, other stages add zeros
        vals = dict(zip(keys, (t / self.par.tp).tolist(), strict=True))
        vals["grad_norm"] = vals["grad_norm"] * self.par.tp / self.tc.updates_per_step
        w = vals.pop("weight") or 1.0
        # Losses are sums of weighted terms per update; the rest are weighted sums: make them means.
        metrics = {k: vals[k] / self.tc.updates_per_step for k in ("loss", "pg_loss", "kl") if k in vals}
        for k in ("clip_frac", "tis_weight", "tis_masked", "train_rollout_logprob_diff", "entropy"):
            if k in vals:
                metrics[k] = vals[k] / w
        metrics["grad_norm"] = vals["grad_norm"]
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["samples"] = float(len(samples))
        metrics["tokens"] = float(sum(s.total_len for s in samples))
        return metrics

    def _my_share(self, samples: list[Sample]) -> list[Sample]:
        parts = self.balancer.partition([s.total_len for s in samples], self.par.dp, self.flops)
        return [samples[i] for i in parts[self.par.dp_rank]]

    def _micro_loss(self, mb: PackedBatch, logits: torch.Tensor, *, adv, weights, old, ref):
        dev = logits.device
        logprobs, ent = self._response_logprobs(mb, logits, entropy=True)
        s = mb.samples
        mask = torch.tensor([m for x in s for m in x.loss_mask], dtype=torch.float32, device=dev)
        rollout = torch.tensor([lp for x in s for lp in x.rollout_logprobs], dtype=torch.float32, device=dev)
        inp = LossInputs(
            logprobs=logprobs,
            old_logprobs=per_token(s, old).to(dev) if old is not None else logprobs.detach(),
            rollout_logprobs=rollout,
            advantages=per_token(s, adv).to(dev),
            weights=per_token(s, weights).to(dev) * mask,
            mask=mask,
            seq_index=mb.seq_index.to(dev),
            ref_logprobs=per_token(s, ref).to(dev) if ref is not None else None,
            entropy=ent if self.tc.entropy_coef else ent.detach(),
        )
        return objective(inp, self.policy_loss, self.objective_cfg)

    # -- weights out -----------------------------------------------------------------------------

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named weights, gathered over tensor and pipeline parallelism (every rank gets them)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        local = {k: v.detach() for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        if self.tc.tp == 1:
            shards = [local]
        else:
            group = ps.get_tensor_model_parallel_group()
            shards = [dict() for _ in range(self.tc.tp)]
            for k, v in local.items():
                parts = [torch.empty_like(v) for _ in range(self.tc.tp)]
                dist.all_gather(parts, v.contiguous(), group=group)
                for r in range(self.tc.tp):
                    shards[r][k] = parts[r]
        hf = self.bridge.to_hf(shards, self.shape, **self._stage())
        if self.tc.pp == 1:
            return hf
        stages: list[Any] = [None] * self.tc.pp
        dist.all_gather_object(stages, {k: v.cpu() for k, v in hf.items()},
                               group=ps.get_pipeline_model_parallel_group())
        return {k: v for stage in stages for k, v in stage.items()}

    # -- checkpoint ------------------------------------------------------------------------------

    def _inner_optimizers(self) -> list:
        """The torch optimizers over this rank's shard of main parameters, inside megatron's wrappers."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [o.optimizer for o in chained]

    def save(self, folder) -> None:
        """Model, this rank's optimizer shard, scheduler, step and RNG into `folder`.

        Optimizer state is saved per rank as torch's own state dict of the shard (megatron's
        gather-to-rank-0 loader expects a fused Adam without a ``step`` entry), so a resume must use
        the same parallel layout.
        """
        import torch.distributed as dist

        inner = self._inner_optimizers()
        torch.save({
            "inner": [o.state_dict() for o in inner],
            "main": [[p.detach().cpu().clone() for g in o.param_groups for p in g["params"]] for o in inner],
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        }, folder / f"optimizer_rank{self.par.rank}.pt")
        if self.par.dp_rank == 0:
            torch.save(self.model.state_dict(), folder / f"model_tp{self.par.tp_rank}_pp{self.par.pp_rank}.pt")
        if self.par.rank == 0:
            torch.save({"scheduler": self.scheduler.state_dict(), "step": self.step,
                        "layout": [self.par.tp, self.par.pp, self.par.dp]}, folder / "trainer.pt")
        dist.barrier()

    def load(self, folder) -> None:
        meta = torch.load(folder / "trainer.pt", weights_only=False)
        if meta["layout"] != [self.par.tp, self.par.pp, self.par.dp]:
            raise RLXError(f"--resume: checkpoint {folder} was written with tp, pp, dp = {meta['layout']}; "
                           f"this run has {[self.par.tp, self.par.pp, self.par.dp]}")
        shard = folder / f"model_tp{self.par.tp_rank}_pp{self.par.pp_rank}.pt"
        self.model.load_state_dict(torch.load(shard, weights_only=False), strict=False)
        opt = torch.load(folder / f"optimizer_rank{self.par.rank}.pt", weights_only=False)
        with torch.no_grad():
            for o, sd, main in zip(self._inner_optimizers(), opt["inner"], opt["main"], strict=True):
                o.load_state_dict(sd)
                for p, v in zip((p for g in o.param_groups for p in g["params"]), main, strict=True):
                    p.copy_(v)
        self.scheduler.load_state_dict(meta["scheduler"])
        self.step = meta["step"]
        torch.set_rng_state(opt["rng"]["torch"])
        random.setstate(opt["rng"]["python"])
        if opt["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(opt["rng"]["cuda"])


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the full vocabulary when its last dim is split over TP ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp = ps.get_tensor_model_parallel_world_size()
    m = logits.detach().max(-1, keepdim=True).values
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    e = torch.exp(logits - m)
    z = e.sum(-1)
    s = (e * logits).sum(-1)
    if tp > 1:
        z = reduce_from_tensor_model_parallel_region(z)
        s = reduce_from_tensor_model_parallel_region(s)
    return torch.log(z) + m[:, 0] - s / z


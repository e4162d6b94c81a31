"""Checks across sections: settings that mean something in one mode (sync or async training, a source of batches,
a reproducible run) only, or that need another setting beside them. Each problem is (key path, message), reported with
the schema's own (`rlx.config.loading`)."""

from __future__ import annotations

from typing import Any

from rlx.config.schema import AsyncConfig, Config


def check_modes(cfg: Config) -> list[tuple[tuple[Any, ...], str]]:
    """Settings that only mean something in one training mode: set in the other, they are errors."""
    problems: list[tuple[tuple[Any, ...], str]] = []
    if cfg.rollout.source == "buffer" and cfg.train.mode == "async":
        problems.append((("train", "mode"), "async mode overlaps generation with training; with rollout.source: "
                         "buffer the trajectories come from outside, so use sync"))
    if cfg.rollout.source == "replay":
        if cfg.rollout.replay is None:
            problems.append((("rollout", "source"), "replay trains on saved batches: set rollout.replay to their file "
                             "or folder (a run's batches/, written with rollout.save_batches, or rl rollout's file)"))
        if cfg.train.mode == "async":
            problems.append((("train", "mode"), "a replay trains on saved batches, step by step: use sync"))
        if cfg.eval.datasets:
            problems.append((("eval", "datasets"), "evaluation generates, and a replay starts no engines"))
    elif cfg.rollout.replay is not None:
        problems.append((("rollout", "replay"), "applies to rollout.source: replay"))
    if cfg.train.mode == "async":
        if cfg.run.deterministic:  # one step off the policy on a fixed schedule (rlx.rollout.batches)
            problems += [(("train", "async", key), "does not apply under run.deterministic, whose async mode runs "
                          "one step off the policy on a fixed schedule (each batch generated whole, while the step "
                          "before trains, on the weights that step started from)")
                         for key, field in AsyncConfig.model_fields.items()
                         if getattr(cfg.train.async_, key) != field.default]  # a dumped config has the defaults
        if cfg.rollout.partial_rollout.enabled:
            problems.append((("rollout", "partial_rollout", "enabled"), "applies to sync mode; async mode always "
                             "carries in-flight samples over (see train.async.swap)"))
        if cfg.rollout.offload_during_train:
            problems.append((("rollout", "offload_during_train"), "async mode generates while it trains, so "
                             "engines cannot release their memory"))
        if cfg.train.offload:
            problems.append((("train", "offload"), "async mode trains while the engines generate, so the trainer "
                             "cannot give its memory to them"))
        if cfg.rollout.partial_rollout.over_sampling != 1.0:
            problems.append((("rollout", "partial_rollout", "over_sampling"), "applies to sync partial rollout; in "
                             "async mode train.async.max_staleness sets how many groups run ahead"))
        if cfg.train.async_.max_staleness < cfg.weight_sync.interval and not cfg.run.deterministic:
            problems.append((("train", "async", "max_staleness"), f"must be at least weight_sync.interval "
                             f"({cfg.weight_sync.interval}): between pushes the engines serve weights up to "
                             f"that many versions old"))
    if cfg.train.offload and cfg.rollout.offload_during_train is False:
        problems.append((("train", "offload"), "the trainer takes its memory back to train, which the engines must "
                         "then have released: leave rollout.offload_during_train on (or both unset: on when "
                         "colocated on GPUs)"))
    if cfg.train.critic.placement != "shared" and cfg.train.critic.parallel is None:
        problems.append((("train", "critic", "placement"), "places a critic with processes of its own: set "
                         "train.critic.parallel too (without it the critic lives in the actor's processes)"))
    if cfg.train.critic.parallel is not None and not cfg.ray.enabled:
        problems.append((("train", "critic", "parallel"), "a critic layout of its own runs in processes of its own: "
                         "set ray.enabled: true (or leave it out: the critic then shares the actor's process)"))
    problems += _quantization(cfg)
    problems += _adapters(cfg)
    if cfg.train.lora is not None:
        obj = cfg.train.objective
        for where, on, why in ((("train", "qat"), cfg.train.qat is not None, "quantisation-aware training quantises "
                              "the weights LoRA freezes, and engines would serve the merged weights quantised"),
                             (("train", "objective", "mtp_loss_coef"), obj.mtp_loss_coef > 0, "LoRA freezes the "
                              "multi-token-prediction layers (no adapters on them)"),
                             (("train", "objective", "indexer_kl_coef"), obj.indexer_kl_coef > 0, "LoRA freezes "
                              "the sparse-attention indexers (no adapters on them)")):
            if on:
                problems.append((where, f"with train.lora: {why}; leave it off"))
        if cfg.train.lora.push == "adapter":
            for where, on, why in (
                    (("weight_sync", "transport"), cfg.weight_sync.transport.name == "broadcast", "SGLang takes "
                     "adapters through its LoRA routes (as tensors or from disk), not from a broadcast group: use "
                     "transport tensor, disk or delta"),
                    (("rollout", "quantization"), cfg.rollout.quantization is not None, "the engines' quantised "
                     "weights are the merged model's; use train.lora.push: merged"),
                    (("rollout", "source"), cfg.rollout.source == "buffer", "trajectories generated outside rlx do "
                     "not name the adapter their engines serve; use train.lora.push: merged")):
                if on:
                    problems.append((where, f"with train.lora.push: adapter: {why}"))
            gdn = sorted(t for t in cfg.train.lora.target_modules if t.startswith("in_proj_") or t == "out_proj")
            for i, g in enumerate(cfg.rollout.engines):
                if g.backend == "sglang" and g.update_weights and gdn:
                    problems.append((("rollout", "engines", i, "backend"), f"with train.lora.push: adapter: SGLang "
                                     f"0.5.23 takes LoRA on gated delta nets ({', '.join(gdn)}) only under its own "
                                     f"fused names, not peft's for the transformers model; use backend: embedded, or "
                                     f"train.lora.push: merged"))
                if not g.update_weights:
                    problems.append((("rollout", "engines", i, "update_weights"), "with train.lora.push: adapter: "
                                     "every request names the adapter pushed last, which engines that take no "
                                     "weights never get; use train.lora.push: merged"))
        par = cfg.train.parallel
        if cfg.train.lora.dropout and (par.tp > 1 or par.ep > 1):
            problems.append((("train", "lora", "dropout"), f"dropout masks are not drawn alike across tensor- and "
                             f"expert-parallel ranks (tp {par.tp}, ep {par.ep}): leave it at 0 there"))
    if cfg.rollout.teachers and cfg.train.objective.distill is None:
        problems.append((("rollout", "teachers"), "teachers score samples for on-policy distillation: set "
                         "train.objective.distill (its coef and estimator) too"))
    if cfg.train.objective.distill is not None and not cfg.rollout.teachers and cfg.rollout.source != "replay":
        problems.append((("train", "objective", "distill"), "distils from rollout.teachers, which lists none (a "
                         "replay's saved samples carry their teachers' scores)"))
    if (any(not t.urls for t in cfg.rollout.teachers) and cfg.ray.enabled and cfg.ray.placement == "colocated"
            and cfg.ray.gpus_per_trainer > 0):
        problems.append((("rollout", "teachers"), "teachers launched on the trainers' GPUs (ray.placement: "
                         "colocated) would keep their memory while the trainer trains: place the engines apart "
                         "(ray.placement: disaggregated) or attach to teachers served elsewhere (urls)"))
    if cfg.rollout.teachers and cfg.rollout.source != "generate":
        problems.append((("rollout", "teachers"), f"teachers score the samples rlx generates; rollout.source "
                         f"{cfg.rollout.source} takes samples made elsewhere"))
    if cfg.train.mode != "async":
        for key, field in AsyncConfig.model_fields.items():
            if getattr(cfg.train.async_, key) != field.default:  # a dumped config has the defaults
                problems.append((("train", "async", key), "applies to train.mode: async only"))
    return problems


def _adapters(cfg: Config) -> list[tuple[tuple[Any, ...], str]]:
    """Multi-LoRA (``train.lora.adapters``): what names an adapter names one, and what the adapters need."""
    lora = cfg.train.lora
    names = [a.name for a in lora.adapters] if lora is not None else []
    problems: list[tuple[tuple[Any, ...], str]] = []
    for i, d in enumerate(cfg.eval.datasets):
        if d.adapter is not None and d.adapter not in names:
            problems.append((("eval", "datasets", i, "adapter"), f"{d.adapter!r} is not one of train.lora.adapters "
                             f"({', '.join(names) or 'none listed'})"))
    if not names:
        return problems
    assert lora is not None
    if cfg.data.path is not None or cfg.data.mix:
        problems.append((("data", "mix" if cfg.data.mix else "path"), "with train.lora.adapters each adapter reads "
                         "its own prompts (train.lora.adapters[*].data): leave data's path and mix out (its column "
                         "keys and limits apply to every adapter's)"))
    if lora.push != "adapter":
        problems.append((("train", "lora", "push"), "several adapters are served beside one base model: merged "
                         "weights would be one model; use push: adapter"))
    if cfg.weight_sync.transport.name not in ("tensor", "disk"):
        problems.append((("weight_sync", "transport"), f"several adapters travel through the tensor or disk "
                         f"transport (a {cfg.weight_sync.transport.name} version is one model's, or one adapter's)"))
    return problems


def _quantization(cfg: Config) -> list[tuple[tuple[Any, ...], str]]:
    """Low-precision rollout and its quantisation-aware training: combinations that cannot work."""
    problems: list[tuple[tuple[Any, ...], str]] = []
    if cfg.train.qat is not None and cfg.rollout.quantization != cfg.train.qat:
        problems.append((("train", "qat"), f"trains the policy an engine serving {cfg.train.qat} weights samples "
                         f"from: set rollout.quantization: {cfg.train.qat} too (it is "
                         f"{cfg.rollout.quantization or 'unset'})"))
    if cfg.rollout.quantization is not None and cfg.weight_sync.transport.name != "tensor":
        problems.append((("weight_sync", "transport"), f"rollout.quantization pushes quantised weights through the "
                         f"tensor transport only: {cfg.weight_sync.transport.name} is not wired for them (gloo cannot "
                         f"broadcast float8; disk and delta write the trainer's dtype)"))
    if cfg.rollout.quantization == "int4":
        for i, g in enumerate(cfg.rollout.engines):
            if g.backend == "sglang" and g.update_weights:
                problems.append((("rollout", "engines", i, "backend"), "INT4 rollout is served by the embedded engine: "
                                 "SGLang's INT4 (W4A16) checkpoint formats and their weight updates are not wired "
                                 "into rlx yet"))
    return problems

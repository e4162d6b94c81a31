"""Train a model a few steps under a parallel layout (gloo on CPU, the ranks forked warm by `rlx.testing.warm`) and
read back what came out, for tests that show a layout trains exactly like one process: model plugins' tests use it
on their tiny models.

`run(folder, model_path, nproc, tp=..., pp=..., ep=..., replay=...)` runs two GRPO steps (two optimizer updates
each, a reference model for the KL) on fixed samples with ragged lengths and returns ``{"m1", "m2", "weights"}``:
each step's metrics and the updated weights in HF names, flattened. With a ``distill`` objective the samples carry
a random teacher's scores (log-probs and top-6 ids). With ``replay`` ``"off"`` or ``"on"`` the samples carry the
routing and log-probs of an "engine": the same model with noise added to its router weights (``noise`` x their
std); ``"on"`` turns on rollout routing replay.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

WORKER = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from rlx.config import parse_config
    from rlx.plugins import build_plugins
    from rlx.train.trainer import Trainer
    from rlx.types import Group, RolloutBatch, Sample, SampleStatus

    args = json.loads(sys.argv[1])
    tp, pp, ep, world, out, replay = (args[k] for k in ("tp", "pp", "ep", "nproc", "out", "replay"))
    cfg = parse_config(json.dumps({
        "run": {"output_dir": out + ".run"}, "ray": {"enabled": False},
        "model": {"path": args["model"]},
        # distillation's teacher: its scores are made below (the trainer never calls it)
        "rollout": {"teachers": [{"name": "t", "urls": ["http://127.0.0.1:9"]}] if "distill" in args["objective"]
                    else []},
        "train": {"parallel": {"tp": tp, "pp": pp, "ep": ep, "world_size": world}, "updates_per_step": 2,
                  "objective": {"kl_coef": 0.1, "entropy_coef": 0.01, "loss_norm": "group",
                                "routing_replay": replay == "on", **args["objective"]},
                  "optim": {"lr": 1e-2, "adam_eps": 1e-4, **args["optim"]}, "lora": args["lora"],
                  "max_tokens_per_micro_batch": 40}}))
    g = torch.Generator().manual_seed(0)

    def sample(gid, sid, n):
        prompt = torch.randint(3, 500, (5,), generator=g).tolist()
        resp = torch.randint(3, 500, (n,), generator=g).tolist()
        return Sample(prompt, resp, [1] * (n - 1) + [0], [-6.2] * n, reward=float(sid % 3),
                      status=SampleStatus.COMPLETED, sample_id=sid, group_id=gid)

    groups, sid = [], 0
    for gid, k in enumerate([3, 2, 4, 1]):
        groups.append(Group(gid, [sample(gid, sid + j, 4 + (sid + j) % 7) for j in range(k)]))
        sid += k
    names = [a["name"] for a in (args["lora"] or {}).get("adapters", [])]
    for group in groups:  # multi-LoRA: the groups of each adapter in turn
        for s in group.samples:
            s.lora = names[group.group_id % len(names)] if names else None
    if args["groups"] is not None:
        groups = [groups[i] for i in args["groups"]]
    if replay != "none":  # an engine whose routers differ from the trainer's: its routing and log-probs
        import base64
        from transformers import AutoModelForCausalLM
        from rlx.models.tiny import resolve_model_path
        engine = AutoModelForCausalLM.from_pretrained(resolve_model_path(args["model"]), dtype=torch.float32).eval()
        noise = torch.Generator().manual_seed(1)
        topk = engine.config.num_experts_per_tok
        with torch.no_grad():
            for layer in engine.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None and hasattr(gate, "weight") and gate.weight.dim() == 2:
                    gate.weight.add_(torch.randn(gate.weight.shape, generator=noise) * gate.weight.std() * args["noise"])
            routed = {}
            for layer_idx, layer in enumerate(engine.model.layers):
                experts = getattr(layer.mlp, "experts", None)
                if experts is not None:
                    experts.register_forward_pre_hook(
                        lambda m, a, i=layer_idx: routed.__setitem__(i, a[1].detach().clone()))
            for group in groups:
                for s in group.samples:
                    full = s.prompt_ids + s.response_ids
                    routed.clear()
                    o = engine(torch.tensor([full[:-1]]))
                    top = torch.zeros(len(full) - 1, len(engine.model.layers), topk, dtype=torch.int32)
                    for i, idx in routed.items():
                        top[:, i] = idx.reshape(len(full) - 1, topk).to(torch.int32)
                    s.routed_experts = base64.b64encode(top.numpy().tobytes()).decode()
                    lp = torch.log_softmax(o.logits[0].float(), -1)
                    p0 = len(s.prompt_ids) - 1
                    s.rollout_logprobs = [lp[p0 + j, t].item() for j, t in enumerate(s.response_ids)]
    if "distill" in args["objective"]:  # a teacher's scores: its log-prob of each token, its top 6 ids at each
        from rlx.types import TeacherScore
        for group in groups:
            for s in group.samples:
                top = [torch.randperm(500, generator=g)[:6].tolist() for _ in s.response_ids]
                lps = [torch.log_softmax(torch.randn(7, generator=g), -1)[:6].sort(descending=True).values.tolist()
                       for _ in s.response_ids]
                s.teacher = TeacherScore("t", [row[0] for row in lps], top, lps)
    trainer = Trainer(cfg, build_plugins())
    m1 = trainer.train_step(RolloutBatch(1, groups))
    m2 = trainer.train_step(RolloutBatch(2, groups))
    mine = {}
    if trainer.par.gathers:
        named = {k: v.flatten().tolist() for k, v in trainer.hf_tensors()}
        mine = named if trainer.par.sender else {}
    if args["lora"]:  # and the adapters as peft lays them out (every rank calls it), multi-LoRA's as <name>@...
        from rlx.train.lora import adapters
        for key in cfg.train.lora.names:
            at = f"{key}@" if key else ""
            for module, a, b in adapters(trainer.actor, cfg.train.lora.target_modules, key):
                if trainer.par.sender:
                    mine[at + module + ".lora_A"], mine[at + module + ".lora_B"] = (a.flatten().tolist(),
                                                                                    b.flatten().tolist())
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, mine)
    if torch.distributed.get_rank() == 0:
        json.dump({"m1": m1, "m2": m2, "weights": {k: v for p in parts for k, v in p.items()}}, open(out, "w"))
    # every rank waits for the result to be written, then leaves its groups before exiting: a gloo group still
    # alive at interpreter exit can abort the process ("terminate called without an active exception")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
""")


def run(folder: Path, model_path: str, nproc: int, tp: int = 1, pp: int = 1, ep: int = 1, replay: str = "none",
        noise: float = 0.25, timeout_s: float = 600, env: dict[str, str] | None = None,
        objective: dict[str, Any] | None = None, optim: dict[str, Any] | None = None,
        lora: dict[str, Any] | None = None, groups: list[int] | None = None) -> dict[str, Any]:
    """`env`: added to the workers' environment (``CUDA_VISIBLE_DEVICES: ""`` runs them on the CPU); `objective`,
    `optim`: more ``train.objective`` and ``train.optim`` settings; `lora`: ``train.lora`` (the weights returned are
    then the merged ones; with ``adapters``, the groups are each adapter's in turn, the weights the base model's, and
    each adapter's factors come as ``<name>@<module>.lora_A``); `groups`: train on these of the four groups only."""
    from rlx.testing.warm import world

    folder = Path(folder)
    script = folder / "parallel_worker.py"
    script.write_text(WORKER)
    more = {"objective": objective or {}, "optim": optim or {}, "lora": lora, "groups": groups}
    out = folder / f"out-{nproc}-{tp}-{pp}-{ep}-{replay}-{abs(hash(json.dumps(more, sort_keys=True)))}.json"
    args = dict(model=model_path, tp=tp, pp=pp, ep=ep, nproc=nproc, out=str(out), replay=replay, noise=noise, **more)
    r = world(script, [json.dumps(args)], nproc, env={"OMP_NUM_THREADS": "1", **(env or {})}, timeout=timeout_s)
    if r.returncode != 0:
        raise AssertionError(f"{nproc} processes, tp={tp} pp={pp} ep={ep} replay={replay}:\n{r.stderr[-4000:]}")
    return json.loads(out.read_text())


def assert_same(got: dict[str, Any], single: dict[str, Any], keys: tuple[str, ...], atol: float = 1e-5) -> None:
    """Every metric in `keys` of both steps, and every updated weight, equal within `atol`."""
    import pytest

    for step in ("m1", "m2"):
        for key in keys:
            assert got[step][key] == pytest.approx(single[step][key], abs=atol), (step, key)
    assert set(got["weights"]) == set(single["weights"])
    worst = max(max(abs(a - b) for a, b in zip(got["weights"][n], w, strict=True))
                for n, w in single["weights"].items())
    assert worst < atol, f"updated weights differ by up to {worst}"

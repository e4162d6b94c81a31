"""Contract test suites that plugin tests subclass (pytest collects the ``test_*`` methods).

One suite per component kind. Each checks what rlx relies on when it calls the component, beyond the
method signatures that registration already checks. Common attributes: the component's name, its
``args`` (config), and ``plugin``: the plugin module to register for the test, or None to use the
installed entry points (which also checks that the distribution's entry point works).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from rlx.plugins import Plugins, build_plugins
from rlx.protocols import LossInputs
from rlx.config import RewardSpec, RolloutConfig
from rlx.rollout.rewards import Rewards
from rlx.types import GenerateResult, Group, RewardResult, Sample, SampleStatus

if TYPE_CHECKING:
    import torch
    from rlx.rollout.engines.client import GenerateRequest

ODD_RESPONSES = [
    "",
    " ",
    "\\boxed{",
    "}}}{{{",
    "∑∫√ 🙂 \x00 \ufffd",
    "9" * 5000,
    "answer: " + "x" * 20000,
    "NaN inf -inf 1e309",
]


class _Contract:
    kind: ClassVar[str]
    component_name: ClassVar[str]
    args: ClassVar[dict[str, Any]] = {}
    plugin: ClassVar[object | None] = None

    def _plugins(self) -> Plugins:
        extra = [(f"contract-{self.component_name}", self.plugin)] if self.plugin is not None else []
        return build_plugins(entry_points=self.plugin is None, extra=extra)

    def build(self, args: dict[str, Any] | None = None) -> Any:
        return self._plugins().build(self.kind, {"name": self.component_name, "args": self.args if args is None
                                                 else args})

    def test_registered_under_its_name(self) -> None:
        assert self.component_name in self._plugins().names(self.kind)

    def test_config_has_defaults(self) -> None:
        self.build({})


# -- rewards -------------------------------------------------------------------------------------


@dataclass
class RewardCase:
    """A response, its label, and the score the reward must give."""

    response: str
    label: Any
    score: float


class RewardContract(_Contract):
    """The reward contract. Set `reward_name` and `cases`; optionally `args`, `plugin`, `score_range`.

    Every case is scored the way ``rl train`` scores it: through `rlx.rollout.rewards.Rewards`, so a sync reward is
    pickled and run in a reward worker process (``rollout.scoring.isolation: process``, the default) and, for
    `test_cases`, in a thread of this process as well (``isolation: thread``). A reward that cannot be sent to a
    worker fails here, not in a run."""

    kind = "rewards"
    reward_name: ClassVar[str]
    cases: ClassVar[list[RewardCase]] = []
    score_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    isolations: ClassVar[tuple[str, ...]] = ("process", "thread")

    @property
    def component_name(self) -> str:  # type: ignore[override]
        return self.reward_name

    def rewards(self, isolation: str = "process") -> Rewards:
        """The reward as a run holds it, from a config entry with this suite's `args`."""
        rc = RolloutConfig(scoring={"isolation": isolation, "workers": 2})
        return Rewards([RewardSpec(name=self.reward_name, args=self.args)], self._plugins(), rc)

    def _score(self, rewards: Rewards, response: str, label: str | None) -> RewardResult:
        sample = Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5], response_text=response, label=label)
        scored = asyncio.run(rewards.score(sample))
        assert scored.status != SampleStatus.FAILED, f"{response[:40]!r}/{label!r}: {scored.error}"
        return scored.rewards[self.reward_name]

    def test_has_cases(self) -> None:
        assert len(self.cases) >= 2, "give at least one case scoring high and one scoring low"
        assert len({c.score for c in self.cases}) >= 2, "cases must not all expect the same score"

    def test_cases(self) -> None:
        for isolation in self.isolations:
            rewards = self.rewards(isolation)
            for case in self.cases:
                got = self._score(rewards, case.response, case.label).score
                assert got == case.score, (f"{case.response!r} vs label {case.label!r} (isolation {isolation}): "
                                           f"{got} != {case.score}")

    def test_odd_input_never_raises_and_stays_in_range(self) -> None:
        rewards = self.rewards()
        lo, hi = self.score_range
        labels = [c.label for c in self.cases[:1]] + [None, ""]
        for response in ODD_RESPONSES:
            for label in labels:
                got = self._score(rewards, response, label).score
                assert lo <= got <= hi, f"{response[:40]!r}/{label!r}: {got} outside {self.score_range}"

    def test_deterministic(self) -> None:
        rewards = self.rewards()
        for case in self.cases:
            assert self._score(rewards, case.response, case.label) == self._score(rewards, case.response, case.label)


# -- advantage estimators and policy losses --------------------------------------------------------


def ragged_groups() -> list[Group]:
    """Three groups of different sizes and response lengths, one failed sample, one all-equal group."""
    sid = 0
    groups = []
    for gid, rewards in enumerate([[1.0, 0.0, 0.5], [0.2, 0.9], [0.4, 0.4, 0.4, 0.4]]):
        samples = []
        for j, r in enumerate(rewards):
            n = 2 + (sid * 3) % 5
            samples.append(Sample([1, 2], list(range(3, 3 + n)), [1] * n, [-1.0] * n, reward=r,
                                  status=SampleStatus.COMPLETED, group_id=gid, sample_id=sid, index=j))
            sid += 1
        groups.append(Group(gid, samples))
    groups[0].samples[1].status = SampleStatus.FAILED
    groups[0].samples[1].reward = None
    return groups


class AdvantageContract(_Contract):
    """An advantage estimator: finite advantages for exactly the trainable scored samples, one per sample
    or one per response token. Set `estimator_name`."""

    kind = "advantages"
    estimator_name: ClassVar[str]

    @property
    def component_name(self) -> str:  # type: ignore[override]
        return self.estimator_name

    def test_advantages_cover_trainable_samples_and_are_finite(self) -> None:
        groups = ragged_groups()
        adv = self.build().advantages([g for g in groups if g.trainable])
        trainable = {s.sample_id: s for g in groups for s in g.trainable}
        assert set(adv) <= set(trainable), f"advantages for samples that cannot train: {set(adv) - set(trainable)}"
        assert adv, "no advantages at all for a batch with reward variance"
        for sid, a in adv.items():
            values = [a] if isinstance(a, (int, float)) else list(a)
            if not isinstance(a, (int, float)):
                assert len(values) == len(trainable[sid].response_ids), f"sample {sid}: one per response token"
            assert all(math.isfinite(v) for v in values), f"sample {sid}: {values}"

    def test_no_groups_gives_no_advantages(self) -> None:
        assert dict(self.build().advantages([])) == {}


class LossContract(_Contract):
    """A policy loss: per-token loss and clip flags of the input's shape, finite, differentiable in the
    current log-probs, zero gradient where advantages are zero, and an empty micro-batch works.
    Set `loss_name`."""

    kind = "losses"
    loss_name: ClassVar[str]

    @property
    def component_name(self) -> str:  # type: ignore[override]
        return self.loss_name

    @staticmethod
    def inputs(n: int = 9, advantages: torch.Tensor | None = None) -> LossInputs:
        import torch

        g = torch.Generator().manual_seed(0)
        lp = (-torch.rand(n, generator=g) * 3).requires_grad_()
        seq = torch.tensor(([0] * (n // 3) + [1] * (n - n // 3 - 1) + [2])[:n], dtype=torch.long)
        adv = advantages if advantages is not None else torch.randn(n, generator=g)
        return LossInputs(logprobs=lp, old_logprobs=lp.detach() + 0.1 * torch.randn(n, generator=g),
                          rollout_logprobs=lp.detach(), advantages=adv, weights=torch.full((n,), 1.0 / max(n, 1)),
                          mask=torch.ones(n), seq_index=seq)

    def test_shapes_finite_and_gradient(self) -> None:
        inp = self.inputs()
        loss, clipped = self.build().loss(inp)
        assert loss.shape == inp.logprobs.shape and clipped.shape == inp.logprobs.shape
        assert bool(loss.isfinite().all())
        (loss * inp.weights).sum().backward()
        assert inp.logprobs.grad is not None and bool(inp.logprobs.grad.isfinite().all())
        assert float(inp.logprobs.grad.abs().sum()) > 0

    def test_zero_advantage_gives_zero_gradient(self) -> None:
        import torch

        inp = self.inputs(advantages=torch.zeros(9))
        loss, _ = self.build().loss(inp)
        (loss * inp.weights).sum().backward()
        grad = inp.logprobs.grad
        assert grad is not None and float(grad.abs().max()) == 0.0

    def test_empty_micro_batch(self) -> None:
        inp = self.inputs(0)
        loss, clipped = self.build().loss(inp)
        assert loss.numel() == 0 and clipped.numel() == 0


# -- generators ------------------------------------------------------------------------------------


class ScriptedEngine:
    """An engine client that answers every generate request with the next scripted ids (logprob -0.5 each)."""

    def __init__(self, outputs: list[list[int]], finish: str = "stop"):
        self.outputs = list(outputs)
        self.finish = finish
        self.requests: list[Any] = []
        self.sampled: list[list[int]] = []

    async def generate(self, req: GenerateRequest, *, retries: int = 0) -> list[Any]:
        self.requests.append(req)
        ids = self.outputs[(len(self.requests) - 1) % len(self.outputs)]
        self.sampled.append(list(ids))
        return [GenerateResult(text="", output_ids=list(ids), output_logprobs=[-0.5] * len(ids),
                               finish_reason=self.finish, matched_stop=None, weight_version="3",
                               token_weight_versions=[], prompt_tokens=len(req.input_ids), rid=req.rid, raw={})]


class GeneratorContract(_Contract):
    """A generator keeps token-in-token-out: the samples it returns hold the prompt it was given, every
    loss-masked token is one the engine sampled (in order), and the per-token lists line up.
    Set `generator_name`; override `tokenizer()` and `sample()` for generators that need more."""

    kind = "generators"
    generator_name: ClassVar[str]
    engine_outputs: ClassVar[list[list[int]]] = [[11, 12, 13, 2]]

    @property
    def component_name(self) -> str:  # type: ignore[override]
        return self.generator_name

    def tokenizer(self) -> Any:
        from rlx.models.tiny import build_tokenizer

        return build_tokenizer()

    def sample(self) -> Sample:
        return Sample(prompt_ids=[1, 5, 6, 7], prompt_text="1+1=", label="2", sample_id=7, group_id=0)

    def run(self) -> tuple[list[Sample], ScriptedEngine, Sample]:
        from rlx.config import SamplingConfig
        from rlx.rollout.context import GenerateContext

        engine = ScriptedEngine(self.engine_outputs)
        ctx = GenerateContext(engine, self.tokenizer(), SamplingConfig(max_new_tokens=8))  # type: ignore[arg-type]
        given = self.sample()
        prompt = list(given.prompt_ids)
        out = asyncio.run(self.build().generate(ctx, given))
        return out, engine, Sample(prompt_ids=prompt)

    def test_samples_are_token_exact(self) -> None:
        out, engine, given = self.run()
        assert isinstance(out, list) and out, "generate returns a non-empty list of samples"
        sampled = [t for ids in engine.sampled for t in ids]
        for s in out:
            assert s.prompt_ids == given.prompt_ids, "the prompt ids must stay as given"
            n = len(s.response_ids)
            assert len(s.loss_mask) == n and s.rollout_logprobs is not None and len(s.rollout_logprobs) == n, \
                "per-token lists must line up"
            model = [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if m]
            assert model, "a sample without model tokens"
            it = iter(sampled)
            assert all(t in it for t in model), "every loss-masked token must be one the engine sampled, in order"
            assert s.status.trainable or s.status == SampleStatus.FAILED


# -- transports ------------------------------------------------------------------------------------


class TransportContract(_Contract):
    """A transport moves the tensors it is sent into real engines: after `send` on every sender and
    `commit`, each engine reports the version and serves exactly the new values. Runs against an embedded
    engine on the built-in tiny model that the session's transport contracts share (``contract_engine``, from
    rlx's pytest plugin; an integration test: it starts a server), loaded back to the model's weights first.
    Set `transport_name`; `senders` > 1 splits the tensors as pipeline stages would."""

    kind = "transports"
    transport_name: ClassVar[str]
    senders: ClassVar[int] = 2

    @property
    def component_name(self) -> str:  # type: ignore[override]
        return self.transport_name

    def test_push_reaches_the_engine(self, tmp_path: Path, contract_engine: tuple[str, str]) -> None:
        import torch
        from safetensors.torch import load_file

        from rlx.rollout.engines.fleet import Engine
        from rlx.transport import TransportContext

        url, path = contract_engine
        state = load_file(f"{path}/model.safetensors")
        engines = [Engine(url, "target")]

        async def reset() -> None:  # the engine is the session's: the model's own weights back, version "0"
            async with engines[0].client() as c:
                await c.update_weights_from_disk(path, weight_version="0")
                assert await c.weight_version() == "0"

        asyncio.run(reset())  # without it, what the test before pushed would pass for this push
        new = {k: v + 0.25 for k, v in state.items()}
        names = list(new)
        parts = [names[i::self.senders] for i in range(self.senders)]

        async def push(version: int) -> None:
            transports = [self.build() for _ in parts]
            ctxs = [TransportContext(engines, tmp_path, sender=i, senders=len(parts)) for i in range(len(parts))]
            for t, c in zip(transports, ctxs, strict=True):
                await t.setup(c)
            for t, c, p in zip(transports, ctxs, parts, strict=True):
                await t.send(iter([(n, new[n]) for n in p]), version, c)
            await transports[0].commit(version, ctxs[0])
            for t in transports:
                await t.close()

        asyncio.run(push(5))

        async def check() -> None:
            from rlx.transport.payloads import tensor_hash

            async with engines[0].client() as c:
                assert await c.weight_version() == "5"
                served = await c.weights_checksum(names)  # every tensor, exactly as the engine holds it
                for name in names:
                    dtype = getattr(torch, served["dtypes"][name])
                    assert served["checksums"][name] == tensor_hash(new[name], dtype), name

        asyncio.run(check())

    def test_an_adapter_push_reaches_the_engine(self, tmp_path: Path, contract_engine: tuple[str, str]) -> None:
        """A transport that says it carries LoRA adapters (``adapters = True``): an adapter push (`rlx.protocols.
        Adapter`: one sender, the adapter whole) leaves the engine reporting the version and serving the adapter as
        the adapter's name, each tensor exactly as sent."""
        import json

        import pytest
        import torch

        from rlx.rollout.engines.fleet import Engine
        from rlx.transport import Adapter, TransportContext
        from rlx.transport.payloads import tensor_hash

        transport = self.build()
        if not getattr(transport, "adapters", False):
            pytest.skip(f"transport {self.transport_name!r} does not carry LoRA adapters (no `adapters = True`)")
        url, path = contract_engine
        c = json.loads((Path(path) / "config.json").read_text())
        q = c["num_attention_heads"] * c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
        g = torch.Generator().manual_seed(0)
        tensors = {}
        for layer in range(c["num_hidden_layers"]):
            key = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
            tensors[f"{key}.lora_A.weight"] = torch.randn(4, c["hidden_size"], generator=g)
            tensors[f"{key}.lora_B.weight"] = torch.randn(q, 4, generator=g)
        adapter = Adapter("actor-v7", {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
        engines = [Engine(url, "target")]
        ctx = TransportContext(engines, tmp_path, adapter=adapter)

        async def push() -> None:
            await transport.setup(ctx)
            await transport.send(iter(tensors.items()), 7, ctx)
            await transport.commit(7, ctx)
            await transport.close()

        async def check() -> None:
            async with engines[0].client() as client:
                try:
                    assert await client.weight_version() == "7"
                    served = await client.request("POST", "/weights_checksum", {"names": list(tensors),
                                                                                 "lora_name": "actor-v7"})
                    assert served["checksums"] == {n: tensor_hash(t, torch.float32) for n, t in tensors.items()}
                finally:
                    await client.unload_lora_adapter("actor-v7")

        asyncio.run(push())
        asyncio.run(check())


# -- loggers ---------------------------------------------------------------------------------------


class LoggerContract(_Contract):
    """A logger records what rlx gives it: opened with a run, it gets metrics for several steps (numbers of
    every kind, and values it must skip without failing: NaN, infinities, strings, booleans, None) and a
    sample table, and is closed; `read_back(output_dir)`, which the plugin's test implements with the
    tracker's own reader, returns ``(config, {step: {key: value}}, {step: sample rows}``); every finite
    number of every step must be there, and the config. A resumed run (`resumed_from`) continues the record.
    Set `logger_name` (and `args`)."""

    kind = "loggers"
    logger_name: ClassVar[str]

    @property
    def component_name(self) -> str:  # type: ignore[override]
        return self.logger_name

    def read_back(self, output_dir: Path) -> tuple[dict[str, Any], dict[int, dict[str, float]],
                                                  dict[int, list[dict[str, Any]]]]:
        raise NotImplementedError(f"{type(self).__name__}: a LoggerContract subclass reads back what its logger "
                                  f"wrote, with the tracker's own reader")

    STEPS: ClassVar[list[dict[str, Any]]] = [
        {"reward/mean": 0.25, "train/loss": -1.5e-3, "rollout/n_samples": 8, "tito/mismatched_samples": 0,
         "perf/step_s": 1.25, "bad/nan": float("nan"), "bad/inf": float("inf"), "bad/text": "x", "bad/flag": True,
         "bad/none": None},
        {"reward/mean": 0.5, "train/loss": 2.0, "rollout/n_samples": 8, "perf/step_s": 0.75, "train/kl": 1e-6},
        {"reward/mean": 0.75, "train/loss": 0.0, "rollout/n_samples": 16, "perf/step_s": 0.5},
    ]
    ROWS: ClassVar[list[dict[str, Any]]] = [
        {"prompt": "What is 2+2?", "response": "4 | four\nnew line", "reward": 1.0},
        {"prompt": "∑ 🙂", "response": "", "reward": 0.0},
    ]

    def _log(self, tmp_path: Path, steps: list[tuple[int, dict[str, Any]]], resumed_from: int | None = None,
             samples_at: int = 2) -> None:
        from rlx.protocols import RunInfo

        logger = self.build()
        run = RunInfo(name="contract", output_dir=tmp_path, config={"run": {"name": "contract", "seed": 3},
                                                                     "train": {"optim": {"lr": 1e-3}}},
                      resumed_from=resumed_from)
        logger.open(run)
        for step, metrics in steps:
            logger.log_metrics(step, dict(metrics))
            if step == samples_at:
                logger.log_samples(step, [dict(r) for r in self.ROWS])
        logger.close()

    @staticmethod
    def _finite(metrics: dict[str, Any]) -> dict[str, float]:
        return {k: float(v) for k, v in metrics.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}

    def test_every_finite_number_of_every_step_the_config_and_the_samples(self, tmp_path: Path) -> None:
        self._log(tmp_path, list(enumerate(self.STEPS, start=1)))
        config, history, tables = self.read_back(tmp_path)
        assert config.get("run", {}).get("seed") == 3 and config.get("train", {}).get("optim", {}).get("lr") == 1e-3
        for step, metrics in enumerate(self.STEPS, start=1):
            assert history.get(step) == pytest.approx(self._finite(metrics)), f"step {step}"
        assert [{k: str(r[k]) if k != "reward" else float(r[k]) for k in ("prompt", "response", "reward")}
                for r in tables[2]] == self.ROWS

    def test_a_resumed_run_continues_where_it_stopped(self, tmp_path: Path) -> None:
        steps = list(enumerate(self.STEPS, start=1))
        self._log(tmp_path, steps[:2])
        self._log(tmp_path, steps[2:], resumed_from=2, samples_at=-1)
        _, history, _ = self.read_back(tmp_path)
        assert sorted(history) == [1, 2, 3]
        assert history[3] == pytest.approx(self._finite(self.STEPS[2]))


# -- model bridges ---------------------------------------------------------------------------------


class ModelBridgeContract(_Contract):
    """A model bridge claims its ``model_type``, returns a `ModelSpec`, and converts HF -> megatron -> HF
    exactly, for every tensor-parallel rank and pipeline stage layout given (checked without megatron:
    the conversions are plain torch). Set `bridge_name`, `model_type` and `make_checkpoint(folder)`
    (write a tiny HF checkpoint there); `layouts` are (tp, pp) or (tp, pp, ep) tuples (experts split over
    ep ranks, expert tensor parallel = tp)."""

    kind = "models"
    bridge_name: ClassVar[str]
    model_type: ClassVar[str]
    layouts: ClassVar[list[tuple[int, ...]]] = [(1, 1), (2, 1), (1, 2), (2, 2)]
    logits_atol: ClassVar[float] = 1e-4

    @property
    def component_name(self) -> str:  # type: ignore[override]
        return self.bridge_name

    def make_checkpoint(self, folder: Path) -> None:
        """Write a tiny HF checkpoint of the bridge's family into `folder` (override this)."""
        pytest.fail(f"{type(self).__name__} must define make_checkpoint(folder): a tiny checkpoint of its family")

    def test_config_has_defaults(self) -> None:
        self._plugins().bridge_for(self.model_type)

    def _spec(self, folder: Path) -> Any:
        from rlx.models.load import load_config
        from rlx.train.spec import ModelSpec

        spec = self._plugins().bridge_for(self.model_type).spec(load_config(folder))
        assert isinstance(spec, ModelSpec)
        return spec

    def test_claims_its_model_type(self) -> None:
        assert self.model_type in self._plugins().component("models", self.bridge_name).obj.model_types

    def test_round_trip_is_exact_for_every_layout(self, tmp_path: Path) -> None:
        """(An FP8 checkpoint's weights are compared dequantised: the trainer holds them so. Multi-token-prediction
        layers: carried, and held by the last stage as when they train, on one stage.)"""
        import torch

        from rlx.models.fp8 import SCALE
        from rlx.train.spec import HFCheckpoint, ShardGather, Stage

        self.make_checkpoint(tmp_path)
        spec = self._spec(tmp_path)
        ckpt = HFCheckpoint(tmp_path)
        reference = {n: ckpt.get(n) for n in ckpt.names()}
        layouts = [(*(*layout, 1)[:3], 0) for layout in self.layouts]
        mtp = spec.mtp_layers if f"model.layers.{spec.num_layers}.eh_proj.weight" in ckpt else 0  # (stored?)
        layouts += [(tp, 1, ep, mtp) for tp, pp, ep, _ in layouts if mtp and pp == 1]
        for layout in layouts:
            tp, pp, ep, mtp = layout
            n = spec.num_layers // pp
            back: dict[str, torch.Tensor] = {}
            for stage_rank in range(pp):
                stages = {(r, e): Stage(stage_rank * n, n, stage_rank == 0, stage_rank == pp - 1, tp_rank=r, tp=tp,
                                        ep_rank=e, ep=ep, etp_rank=r, etp=tp, mtp=mtp if stage_rank == pp - 1 else 0)
                          for r in range(tp) for e in range(ep)}
                shards = {k: dict(spec.to_megatron(spec.read(tmp_path), st)) for k, st in stages.items()}
                assert all(set(s) == set(shards[(0, 0)]) for s in shards.values())
                back.update(spec.hf_tensors(stages[(0, 0)], ShardGather(shards, tp, ep)))
            lm_head = {spec.wrapper.outer("lm_head.weight") if spec.wrapper else "lm_head.weight"}
            scales = {n for n in reference if n.endswith(SCALE)}  # an FP8 checkpoint's: read dequantised, in `get`
            carried = set(spec.carried(ckpt.names())) - set(back)  # (trained MTP layers are not carried)
            expected = set(reference) - carried - scales - (lm_head if spec.tied else set())
            assert set(back) == expected, f"{layout}: {sorted(set(back) ^ expected)[:5]}"
            for name, t in back.items():
                assert torch.equal(t, reference[name]), f"{layout}: {name} differs after the round trip"

    @pytest.mark.integration
    def test_megatron_logits_match_hf(self, tmp_path: Path) -> None:
        """The megatron model the spec builds gives the HF model's logits (fp32, CPU, within `logits_atol`).
        Runs in a subprocess: megatron on CPU changes torch globally."""
        import json
        import subprocess
        import sys

        from rlx.rollout.engines.launch import free_port

        self.make_checkpoint(tmp_path)
        module = getattr(self.plugin, "__name__", "") if self.plugin is not None else ""
        r = subprocess.run([sys.executable, "-c", _LOGITS_SCRIPT, str(tmp_path), self.model_type, module,
                            str(free_port())], capture_output=True, text=True, timeout=300)
        lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        assert lines, r.stderr[-3000:]
        got = json.loads(lines[0][len("RESULT "):])
        assert got["missing"] == [], f"the bridge left megatron weights unset: {got['missing']}"
        assert got["max_abs_err"] < self.logits_atol, got

    def test_flops_model_grows_with_length(self, tmp_path: Path) -> None:
        self.make_checkpoint(tmp_path)
        f = self._spec(tmp_path).flops
        assert 0 < f.cost(100) < f.cost(200)


_LOGITS_SCRIPT = """
import importlib, json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
from rlx.train.megatron_patches.cpu import enable
enable()
folder, model_type, module, port = sys.argv[1:5]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
import torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
model_parallel_cuda_manual_seed(1)
from rlx.models.load import load_config, load_lm
from rlx.config import ParallelConfig
from rlx.plugins import build_plugins
from rlx.train.spec import Stage
extra = [(module, importlib.import_module(module))] if module else []
plugins = build_plugins(entry_points=not extra, extra=extra)
hf = load_lm(folder, torch.float32).eval()
spec = plugins.bridge_for(model_type).spec(load_config(folder))
stage = Stage(0, spec.num_layers, True, True)
model = spec.build(spec.transformer_config(ParallelConfig(), torch.float32), stage)
state = dict(spec.to_megatron(spec.read(folder), stage))
missing = [k for k in model.state_dict() if k not in state and not k.endswith("_extra_state")]
model.load_state_dict(state, strict=False)
ids = torch.randint(3, spec.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
mask = ~torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
with torch.no_grad():
    got = model(ids, torch.arange(12)[None], attention_mask=mask)
    want = hf(ids).logits
print("RESULT", json.dumps({"missing": missing, "max_abs_err": (got - want).abs().max().item()}))
"""


# -- kernels ---------------------------------------------------------------------------------------


class KernelContract(_Contract):
    """A kernel says where it runs (`supports` returns None or a reason, never raises) and, where it runs,
    matches the reference implementation. Set `kernel_name`, `queries` (dicts for `supports`),
    `example()` -> (args, kwargs) and `reference(*args, **kwargs)`; `atol` for the comparison."""

    kind = "kernels"
    kernel_name: ClassVar[str]
    queries: ClassVar[list[dict[str, Any]]] = [{"device": "cpu", "dtype": "float32"}]
    atol: ClassVar[float] = 1e-5

    @property
    def component_name(self) -> str:  # type: ignore[override]
        return self.kernel_name

    def example(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """(args, kwargs) of one call of the kernel (override this)."""
        pytest.fail(f"{type(self).__name__} must define example() -> (args, kwargs)")

    def reference(self, *args: Any, **kwargs: Any) -> Any:
        """What the kernel must compute, in plain torch (override this)."""
        pytest.fail(f"{type(self).__name__} must define reference(*args, **kwargs)")

    def test_supports_answers_without_raising(self) -> None:
        k = self.build()
        for q in self.queries:
            got = k.supports(**q)
            assert got is None or (isinstance(got, str) and got), f"{q}: supports() must return None or a reason"

    def test_matches_reference_where_supported(self) -> None:
        import torch

        k = self.build()
        if k.supports(**self.queries[0]) is not None:
            pytest.skip(f"kernel {self.kernel_name!r} does not run here: {k.supports(**self.queries[0])}")
        args, kwargs = self.example()
        got, want = k(*args, **kwargs), self.reference(*args, **kwargs)
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for g, w in zip(got, want, strict=True):
            assert torch.allclose(g, w, atol=self.atol), f"max difference {(g - w).abs().max().item()}"

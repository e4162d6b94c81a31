"""Evaluation metrics by hand: pass@k (Chen et al. 2021), means over ragged groups, failures scored 0."""


import pytest

from rlx.config import EvalDatasetConfig, SamplingConfig
from rlx.rollout.evaluator import dataset_metrics, pass_at_k, table
from rlx.types import Sample, SampleStatus


def test_pass_at_k_by_hand():
    # n=5 samples, c=2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # pass@5 with 2 correct: every draw of 5 holds a correct one
    assert pass_at_k(5, 2, 5) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(1, 1, 1) == 1.0
    # the estimator equals the exact probability by enumeration
    from itertools import combinations

    draws = list(combinations([1, 1, 0, 0, 0, 0], 3))
    assert pass_at_k(6, 2, 3) == pytest.approx(sum(any(d) for d in draws) / len(draws))
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def sample(reward, status=SampleStatus.COMPLETED, n_tokens=3, **meta):
    s = Sample(prompt_ids=[1], response_ids=list(range(n_tokens)), reward=reward, status=status)
    s.metadata.update(meta)
    return s


def test_dataset_metrics_over_ragged_groups_with_failures():
    spec = EvalDatasetConfig(name="math", path="x.jsonl", n_samples=3, correct_at=1.0)
    groups = [
        [sample(1.0), sample(0.5, n_tokens=5), sample(1.0, SampleStatus.TRUNCATED, n_tokens=8)],  # 2 of 3 correct
        [sample(0.0), sample(None, SampleStatus.FAILED, n_tokens=0), sample(1.5)],  # 1 correct; a failure
        [sample(1.0)],  # a ragged group (an agent run that kept one trajectory): 1 of 1
    ]
    m = dataset_metrics(spec, groups)
    assert m["eval/math/n_prompts"] == 3
    assert m["eval/math/reward_mean"] == pytest.approx((1 + 0.5 + 1 + 0 + 0 + 1.5 + 1) / 7)  # failed counts 0
    assert m["eval/math/failed"] == 1
    assert m["eval/math/truncated_frac"] == pytest.approx(1 / 7)
    assert m["eval/math/response_len_mean"] == pytest.approx((3 + 5 + 8 + 3 + 0 + 3 + 3) / 7)
    assert m["eval/math/pass@1"] == pytest.approx((2 / 3 + 1 / 3 + 1) / 3)
    # pass@3 per prompt: 1, 1 - C(2,3)/C(3,3) = 1, and a group of 1 cannot draw 3: k is clipped to its size
    assert m["eval/math/pass@3"] == pytest.approx(1.0)
    assert "eval/math/turns_mean" not in m


def test_agent_turns_and_empty_datasets():
    spec = EvalDatasetConfig(name="agent", path="x.jsonl")
    m = dataset_metrics(spec, [[sample(1.0, agent_turns=3)], [sample(0.0, agent_turns=1)]])
    assert m["eval/agent/turns_mean"] == 2 and m["eval/agent/pass@1"] == 0.5
    empty = dataset_metrics(spec, [])
    assert empty["eval/agent/reward_mean"] == 0.0 and empty["eval/agent/pass@1"] == 0.0


def test_greedy_by_default_for_one_sample_and_the_rollouts_sampling_for_more():
    rollout = SamplingConfig(temperature=0.8, max_new_tokens=32)
    assert EvalDatasetConfig(name="a", path="x").effective_sampling(rollout).temperature == 0.0
    assert EvalDatasetConfig(name="a", path="x").effective_sampling(rollout).max_new_tokens == 32
    assert EvalDatasetConfig(name="a", path="x", n_samples=4).effective_sampling(rollout).temperature == 0.8
    own = SamplingConfig(temperature=0.6)
    assert EvalDatasetConfig(name="a", path="x", sampling=own).effective_sampling(rollout) is own


def test_table_has_a_row_per_dataset():
    text = table({"eval/a/pass@1": 0.5, "eval/a/reward_mean": 0.25, "eval/b/pass@1": 1.0, "eval/a/time_s": 3},
                 ["a", "b"])
    lines = text.splitlines()
    assert lines[0].split() == ["dataset", "pass@1", "reward_mean"]
    assert lines[1].split() == ["a", "0.5", "0.25"] and lines[2].split() == ["b", "1", "-"]


def test_rl_eval_serves_a_multi_lora_runs_exported_adapters_to_the_datasets_that_name_them(tmp_path):
    """`rl eval --checkpoint` of a multi-LoRA run: each adapter an eval dataset names is loaded into every engine from
    the export (``adapter-<name>``, peft's folder) and that dataset's requests name it; an export without it is an
    error naming the dataset and the folder."""
    import asyncio
    import json

    from rlx.config import parse_config
    from rlx.errors import RLXError
    from rlx.orchestrate.evals import serve_exported_adapters
    from rlx.rollout.context import ServedAdapter

    cfg = parse_config(json.dumps({
        "model": {"path": "/m"},
        "train": {"lora": {"adapters": [{"name": n, "data": {"path": f"{n}.jsonl"}} for n in ("add", "sub")]}},
        "eval": {"datasets": [{"name": "a", "path": "e.jsonl", "adapter": "add"}, {"name": "b", "path": "e.jsonl"}]}}))
    loaded = []

    class Client:
        async def load_lora_adapter(self, name, path):
            loaded.append((name, path))

    class Session:
        class fleet:
            @staticmethod
            async def for_each(fn):
                return [await fn(Client()) for _ in range(2)]  # two engines

        class ctx:
            adapters = {"add": ServedAdapter(on=True), "sub": ServedAdapter(on=True)}

    (tmp_path / "adapter-add").mkdir()
    (tmp_path / "adapter-add" / "adapter_config.json").write_text("{}")
    asyncio.run(serve_exported_adapters(cfg, Session, tmp_path))  # type: ignore[arg-type]
    assert loaded == [("add", str(tmp_path / "adapter-add"))] * 2
    assert Session.ctx.adapters["add"].name == "add" and Session.ctx.adapters["sub"].name is None  # (no dataset's)
    Session.ctx.adapters["add"] = ServedAdapter(on=True)
    with pytest.raises(RLXError, match=r"eval.datasets\[0\].adapter 'add': .* has no adapter-add"):
        asyncio.run(serve_exported_adapters(cfg, Session, tmp_path / "elsewhere"))  # type: ignore[arg-type]

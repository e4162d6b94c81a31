"""rollout.source: replay reads saved batches (one whole group a line, with its step) and hands step k the groups saved
for it; what it cannot read or does not hold is an error naming the file, the line or the steps it holds."""

import asyncio
import json

import pytest

from rlx.config import parse_config
from rlx.data.replay import ReplayBatches, read_batches, save_batch
from rlx.errors import RLXError
from rlx.types import Group, RewardResult, RolloutBatch, Sample, SampleStatus


def batch(step):
    samples = [Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], loss_mask=[1, 0, 1], rollout_logprobs=[-0.5, 0, -0.25],
                      reward=float(i), rewards={"exact_match": RewardResult(float(i), info={"parsed": "x"})},
                      status=SampleStatus.COMPLETED, group_id=step, sample_id=10 * step + i, index=i,
                      token_versions=[step - 1] * 3, metadata={"sampling": {"temperature": 0.5}})
               for i in range(2)]
    return RolloutBatch(step, [Group(step, samples, prompt_index=7)], weight_version=step - 1)


def source(tmp_path, path):
    cfg = parse_config(json.dumps({"model": {"path": "/m"}, "rollout": {"source": "replay", "replay": str(path)}}))
    return ReplayBatches(cfg)


def test_a_saved_step_comes_back_whole_with_the_metrics_its_samples_give(tmp_path):
    for step in (1, 2, 3):
        save_batch(batch(step), tmp_path / "batches")
    assert sorted(p.name for p in (tmp_path / "batches").iterdir()) == [f"step-00000{k}.jsonl" for k in (1, 2, 3)]
    got = asyncio.run(source(tmp_path, tmp_path / "batches").next_batch(2, version=5))
    want = batch(2)
    assert got.step == 2 and got.weight_version == 5
    assert [s.to_dict() for s in got.samples] == [s.to_dict() for s in want.samples]
    assert got.groups[0].prompt_index == 7
    assert {k: v for k, v in got.metrics.items() if k != "time/rollout_s"} == want.sample_metrics()
    assert got.metrics["reward/mean"] == 0.5 and got.metrics["reward/exact_match/mean"] == 0.5


def test_what_it_cannot_read_or_does_not_hold_is_named(tmp_path):
    save_batch(batch(1), tmp_path / "b")
    save_batch(batch(2), tmp_path / "b")
    with pytest.raises(RLXError, match=r"has no batch for step 3; it holds steps 1-2"):
        asyncio.run(source(tmp_path, tmp_path / "b").next_batch(3, 0))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"step": 1, **batch(1).groups[0].to_dict()}) + "\n{oops\n")
    with pytest.raises(RLXError, match=rf"{bad}:2: not a saved group \(JSONDecodeError"):
        read_batches(bad)
    bad.write_text(json.dumps({"step": 1, "group_id": 1}) + "\n")
    with pytest.raises(RLXError, match=rf"{bad}:1: not a saved group \(KeyError: 'samples'\)"):
        read_batches(bad)
    with pytest.raises(RLXError, match="does not exist"):
        read_batches(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RLXError, match="holds no saved batch"):
        read_batches(tmp_path / "empty")

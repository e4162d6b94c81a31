
from rlx.types import Group, RewardResult, RolloutBatch, Sample, SampleStatus


def test_sample_round_trips_through_dict():
    s = Sample([1, 2], [3, 4], [1, 0], [-0.5, 0.0], reward=1.0, status=SampleStatus.TRUNCATED,
               rewards={"math": RewardResult(1.0, {"correct": 1.0})}, group_id=7, sample_id=70)
    d = s.to_dict()
    assert d["status"] == "truncated"
    assert Sample.from_dict(d) == s


def test_only_completed_and_truncated_are_trainable():
    assert {s for s in SampleStatus if s.trainable} == {SampleStatus.COMPLETED, SampleStatus.TRUNCATED}


def test_group_and_batch_views():
    g1 = Group(0, [Sample([1, 2], [3], status=SampleStatus.COMPLETED, reward=1.0),
                   Sample([1, 2], [3, 4], status=SampleStatus.FAILED)])
    g2 = Group(1, [Sample([5], [6, 7, 8], status=SampleStatus.TRUNCATED, reward=0.0)])
    batch = RolloutBatch(step=1, groups=[g1, g2])
    assert g1.rewards == [1.0] and len(g1.trainable) == 1
    assert len(batch.samples) == 3
    assert batch.num_tokens == 3 + 4 + 4

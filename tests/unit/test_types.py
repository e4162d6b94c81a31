
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


def test_speculative_counts_from_sglangs_meta_info_add_up_over_turns_into_the_steps_rates():
    """SGLang's per-request speculative fields (0.5.23: spec_verify_ct, spec_num_proposed_drafts,
    spec_num_correct_drafts) summed over a sample's turns; by hand: drafts taken (3 + 5 + 0) of (4 + 4 + 8) proposed
    = 0.5, and (4 + 6 + 2) tokens over (2 + 3 + 2) verify steps; a result without them (speculation off, an older
    SGLang) adds nothing."""
    from rlx.rollout.context import append_model_tokens
    from rlx.types import GenerateResult

    def result(n, verify=None, proposed=None, correct=None):
        meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.1, 9, None]] * n}
        if verify is not None:
            meta.update(spec_verify_ct=verify, spec_num_proposed_drafts=proposed, spec_num_correct_drafts=correct)
        return GenerateResult.from_json({"text": "", "output_ids": [9] * n, "meta_info": meta})

    a, b = Sample([1], [], status=SampleStatus.COMPLETED), Sample([1], [], status=SampleStatus.COMPLETED)
    for res in (result(4, 2, 4, 3), result(3), result(6, 3, 4, 5)):
        append_model_tokens(a, res)
    append_model_tokens(b, result(2, 2, 8, 0))
    assert a.metadata["speculative"] == [5, 8, 8, 10]
    m = RolloutBatch(1, [Group(0, [a, b])]).sample_metrics()
    assert m["rollout/spec_accept_rate"] == 0.5 and m["rollout/spec_accept_length"] == 12 / 7
    assert "rollout/spec_accept_rate" not in RolloutBatch(1, [Group(0, [Sample([1], [2])])]).sample_metrics()

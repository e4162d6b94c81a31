"""On-policy distillation's pieces, each against values computed by hand: the token estimator's advantages, the
top-k estimator's KL and its gradient, the per-teacher metrics, the config's refusals and what a teacher's fleet
is launched with. Teachers scoring over HTTP and `rl train` with them: tests/integration/test_distill_run.py."""

import json
import math

import pytest
import torch

from rlx.config import parse_config
from rlx.errors import ConfigError
from rlx.train.batch import TrainBatch
from rlx.train.distill import TAIL_FLOOR, distill_advantages, teacher_top, topk_reverse_kl, vocab_logprobs
from rlx.types import Group, RolloutBatch, Sample, SampleStatus, TeacherScore

TEACHER = {"name": "t", "model_path": "builtin://tiny-qwen3-arith"}


def sample(sid, lps, teacher, mask=None, top=None):
    n = len(lps) if lps is not None else len(teacher)
    s = Sample(prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)), loss_mask=mask or [1] * n,
               rollout_logprobs=lps, status=SampleStatus.COMPLETED, sample_id=sid)
    if teacher is not None:
        s.teacher = TeacherScore("t", teacher, *(top or ([], [])))
    return s


def test_the_token_estimator_subtracts_coef_times_sampler_minus_teacher_on_model_tokens_only():
    """Ragged lengths, a tool token (mask 0), a sample its row gave no teacher, one without the sampler's
    log-probs (a buffer's), fan-out (one group's advantage on every token)."""
    a = sample(0, [-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5])
    b = sample(1, [-0.2, -3.0, -1.0, -0.1, -0.7], [-0.1, -9.0, -2.0, -0.1, -0.2], mask=[1, 0, 0, 1, 1])
    c = sample(2, [-1.0, -1.0], None)
    d = sample(3, None, [-1.0, -4.0])
    samples = [a, b, c, d]
    tb = TrainBatch(1, [], samples, {s.sample_id: torch.full((len(s.response_ids),), 0.5) for s in samples}, {})
    distill_advantages(tb, coef=2.0)
    # a: 0.5 - 2 * ((-1)-(-1.5), (-2)-(-1), (-0.5)-(-0.5)) = 0.5 - 2 * (0.5, -1, 0)
    assert tb.advantages[0].tolist() == pytest.approx([-0.5, 2.5, 0.5])
    # b: masked tokens keep the task's advantage; (-0.2)-(-0.1) = -0.1, 0, (-0.7)-(-0.2) = -0.5
    assert tb.advantages[1].tolist() == pytest.approx([0.7, 0.5, 0.5, 0.5, 1.5])
    assert tb.advantages[2].tolist() == [0.5, 0.5] and tb.advantages[3].tolist() == [0.5, 0.5]


def test_the_per_teacher_reverse_kl_is_the_mean_over_model_tokens_of_sampler_minus_teacher():
    a = sample(0, [-1.0, -2.0], [-1.5, -1.0])  # 0.5 + (-1) over 2 tokens
    b = sample(1, [-0.2, -3.0, -1.0], [-0.1, -9.0, -2.0], mask=[1, 0, 1])  # -0.1 + 1 over 2 (the tool token not)
    b.teacher.name = "u"
    c = sample(2, [-1.0], None)
    failed = sample(3, [-5.0], [-1.0])
    failed.status = SampleStatus.FAILED
    m = RolloutBatch(1, [Group(0, [a, b, c, failed])]).sample_metrics()
    assert m["distill/t/reverse_kl"] == pytest.approx(-0.25)
    assert m["distill/u/reverse_kl"] == pytest.approx(0.45)
    assert m["distill/reverse_kl"] == pytest.approx((-0.5 + 0.9) / 4)
    assert "distill/reverse_kl" not in RolloutBatch(1, [Group(0, [c])]).sample_metrics()


def test_top_k_kl_over_the_teachers_tokens_and_the_rest_by_hand():
    """p = (.4, .3, .2, .1), teacher q = (.1, .2, .3, .4), its top 2 are ids 3 and 2: buckets (.1, .2, rest .7)
    against (.4, .3, rest .3): .1 ln(.1/.4) + .2 ln(.2/.3) + .7 ln(.7/.3) = 0.373387. With all 4 ids it is the
    exact KL(p || q) = .4 ln 4 + .3 ln 1.5 + .2 ln(2/3) + .1 ln(1/4) = 0.456436, of which the 2 are a lower bound."""
    p = torch.tensor([[.4, .3, .2, .1]]).log()
    q = torch.tensor([[.1, .2, .3, .4]]).log()
    top2 = torch.tensor([[3, 2]])
    kl2 = topk_reverse_kl(p.gather(-1, top2), q.gather(-1, top2))
    assert kl2.item() == pytest.approx(0.373387, abs=1e-5)
    every = torch.tensor([[0, 1, 2, 3]])
    assert topk_reverse_kl(p.gather(-1, every), q.gather(-1, every)).item() == pytest.approx(0.456436, abs=1e-5)
    # the teacher's k holding all its mass, the student's not: the rest's floor keeps it finite, and large
    full = torch.tensor([[math.log(.5), math.log(.5)]], dtype=torch.float64)
    student = torch.tensor([[math.log(.3), math.log(.3)]], dtype=torch.float64)
    expected = 2 * .3 * math.log(.3 / .5) + .4 * math.log(.4 / TAIL_FLOOR)  # 6.69526
    assert topk_reverse_kl(student, full).item() == pytest.approx(expected, rel=1e-6)


def test_top_k_ids_the_student_has_not_count_in_the_rest():
    """A teacher with a larger (padded) vocabulary may name ids past the student's logits: masked out, their
    teacher mass goes to the rest. p = (.4, .3, .2, .1); the teacher names id 3 (q .4) and id 9 (q .3, the student
    has none): buckets (.1, rest .9) against (.4, rest .6): .1 ln(.1/.4) + .9 ln(.9/.6) = 0.226294."""
    p = torch.tensor([[.4, .3, .2, .1]]).log()
    student = p.gather(-1, torch.tensor([[3, 3]]))  # id 9 clamped to the last column, then masked
    teacher = torch.tensor([[.4, .3]]).log()
    kl = topk_reverse_kl(student, teacher, torch.tensor([[True, False]]))
    assert kl.item() == pytest.approx(.1 * math.log(.1 / .4) + .9 * math.log(.9 / .6), abs=1e-6)


def test_top_k_kl_from_logits_moves_the_student_to_the_teacher():
    """The loss is differentiable in the student's logits (`vocab_logprobs` on one rank is log-softmax at the
    ids): gradient steps on it lower the exact KL too."""
    torch.manual_seed(0)
    logits = torch.randn(3, 16, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(3, 16) * 2, -1)
    top = teacher.topk(4, -1)
    exact = lambda: (torch.softmax(logits, -1) * (torch.log_softmax(logits, -1) - teacher)).sum(-1).mean().item()  # noqa: E731
    before = exact()
    opt = torch.optim.SGD([logits], lr=0.5)
    for _ in range(50):
        student = vocab_logprobs(logits, top.indices)
        assert torch.allclose(student, torch.log_softmax(logits, -1).gather(-1, top.indices))
        opt.zero_grad()
        topk_reverse_kl(student, top.values).sum().backward()
        opt.step()
    assert exact() < before / 3


def test_teacher_top_lays_out_rows_and_marks_samples_no_teacher_scored():
    a = sample(0, [-1.0, -1.0], [-1.0, -1.0], top=([[5, 6, 7], [8, 9, 10]], [[-.1, -2., -3.], [-.2, -3., -4.]]))
    b = sample(1, [-1.0], None)
    ids, lps, scored = teacher_top([a, b], 2)
    assert ids.tolist() == [[5, 6], [8, 9], [0, 0]]
    assert lps[:2].flatten().tolist() == pytest.approx([-.1, -2., -.2, -3.])
    assert lps[2].tolist() == pytest.approx([-math.log(2)] * 2) and scored.tolist() == [1.0, 1.0, 0.0]
    assert torch.isfinite(topk_reverse_kl(torch.log_softmax(torch.zeros(3, 12), -1).gather(-1, ids), lps)).all()
    assert teacher_top([a, b], 10)[0].shape == (3, 3)  # a vocabulary smaller than k: the teacher gave all 3 ids


def test_a_sample_keeps_its_teachers_scores_through_a_round_trip():
    s = sample(0, [-1.0], [-2.0], top=([[3, 4]], [[-.5, -1.5]]))
    again = Sample.from_dict(s.to_dict())
    assert again.teacher == s.teacher and isinstance(again.teacher, TeacherScore)


def config(**rollout_and_train):
    data = {"model": {"path": "builtin://tiny-qwen3"}, "rollout": {}, "train": {}}
    for k, v in rollout_and_train.items():
        data["train" if k == "objective" else "rollout"][k] = v
    return parse_config(json.dumps(data))


def errors(**kw) -> str:
    with pytest.raises(ConfigError) as e:
        config(**kw)
    return str(e.value)


def test_the_config_refuses_teachers_without_distill_and_back_and_what_a_teacher_cannot_be():
    assert config(teachers=[TEACHER], objective={"distill": {"estimator": "top_k", "top_k": 5}}).train.objective.\
        distill.top_k == 5
    assert "set train.objective.distill" in errors(teachers=[TEACHER])
    assert "distils from rollout.teachers, which lists none" in errors(objective={"distill": {}})
    # a replay's saved samples carry their teachers' scores: distillation without teachers
    assert config(source="replay", replay="/b", objective={"distill": {}}).train.objective.distill.coef == 1.0
    two = [TEACHER, {**TEACHER, "name": "u"}]
    assert "with several teachers, the metadata key" in errors(teachers=two, objective={"distill": {}})
    assert config(teachers=two, teacher_field="teacher", objective={"distill": {}}).rollout.teacher_field == "teacher"
    assert "names must be unique" in errors(teachers=[TEACHER, TEACHER], teacher_field="x", objective={"distill": {}})
    assert "a teacher is not trained" in errors(teachers=[{**TEACHER, "update_weights": True}],
                                                objective={"distill": {}})
    assert "the teacher's checkpoint (or urls" in errors(teachers=[{"name": "t"}], objective={"distill": {}})
    assert "apply to the engines that generate" in errors(
        teachers=[{**TEACHER, "speculative": {"method": "ngram"}}], objective={"distill": {}})
    assert "rollout.teachers lists none" in errors(teacher_field="x")
    assert "takes samples made elsewhere" in errors(teachers=[TEACHER], source="buffer", objective={"distill": {}})
    assert "greater than 0" in errors(teachers=[TEACHER], objective={"distill": {"coef": 0}})
    assert "num_engines: says how to launch the teacher's engines, and urls attaches" in errors(
        teachers=[{"name": "t", "urls": ["http://x"], "num_engines": 2}], objective={"distill": {}})
    assert config(teachers=[{"name": "t", "urls": ["http://x"], "model_path": "/m"}],
                  objective={"distill": {}}).rollout.teachers[0].model_path == "/m"  # for the tokenizer check
    assert "the width of the top_k estimator (estimator is token)" in errors(
        teachers=[TEACHER], objective={"distill": {"top_k": 5}})
    with pytest.raises(ConfigError, match="would keep their memory while the trainer trains"):
        parse_config(json.dumps({"model": {"path": "builtin://tiny-qwen3"}, "rollout": {"teachers": [TEACHER]},
                                 "train": {"objective": {"distill": {}}},
                                 "ray": {"placement": "colocated", "gpus_per_trainer": 1}}))
    # a dumped config (every key, defaults too) parses again, as workers read it
    dumped = config(teachers=[TEACHER, {"name": "u", "urls": ["http://x"]}], teacher_field="f",
                    objective={"distill": {"estimator": "top_k", "top_k": 3}})
    assert parse_config(dumped.to_json()) == dumped


def test_a_teachers_fleet_is_its_own_group_without_what_the_students_engines_are_launched_for():
    from rlx.orchestrate.placement import launched_engines
    from rlx.rollout.teachers import teacher_config

    cfg = config(teachers=[{**TEACHER, "num_engines": 2}, {"name": "far", "urls": ["http://10.0.0.9:30000"]}],
                 teacher_field="teacher", objective={"distill": {}, "routing_replay": True}, quantization="fp8",
                 router={"port": 31000}, engines=[{"num_engines": 3}])
    t = teacher_config(cfg, cfg.rollout.teachers[0])
    (g,) = t.rollout.engines
    assert (g.name, g.model_path, g.num_engines, g.update_weights) == ("t", "builtin://tiny-qwen3-arith", 2, False)
    assert t.rollout.quantization is None and not t.rollout.routed_experts and not t.train.objective.routing_replay
    assert t.rollout.router.port is None and t.rollout.external_engines == []
    assert teacher_config(cfg, cfg.rollout.teachers[1]).rollout.external_engines == ["http://10.0.0.9:30000"]
    assert launched_engines(cfg) == 3 + 2  # the attached teacher is not launched
    attached = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"external_engines": ["http://x"]})})
    assert launched_engines(attached) == 2


def test_preflight_refuses_a_teacher_with_another_tokenizer(tmp_path, tiny_model_path):
    from rlx.config import load_config
    from rlx.preflight import config_checks

    from rlx.testing.models import other_tokenizer

    other = other_tokenizer(tiny_model_path, tmp_path / "other")
    p = tmp_path / "c.yaml"
    text = (f"model: {{path: {tiny_model_path}}}\nrollout:\n  teachers: [{{name: t, model_path: TEACHER}}]\n"
            f"train: {{objective: {{distill: {{}}}}}}\n")
    p.write_text(text.replace("TEACHER", str(tiny_model_path)))
    assert load_config(p, checks=config_checks(files=True)).rollout.teachers[0].name == "t"
    p.write_text(text.replace("TEACHER", str(other)))
    with pytest.raises(ConfigError) as e:
        load_config(p, checks=config_checks(files=True))
    (where, why), = e.value.problems
    assert where == f"{p}:3: rollout.teachers[0].model_path"
    assert why.startswith(f"teacher 't' ({other}) has another tokenizer than the student (")
    assert "; 4 vocabulary entries differ): it would score other words than the student wrote" in why

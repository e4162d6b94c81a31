"""On-policy distillation as a run uses it: teachers launched as engines of their own (and attached by address)
score samples over HTTP, checked against a forward pass of the teacher; a multi-turn sample is scored on the
model's tokens only; rows pick their teacher; `rl train` distils with the top-k estimator."""

import asyncio
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlx.config import parse_config
from rlx.errors import RLXError
from rlx.rollout.teachers import Teachers
from rlx.testing.runs import small_run_config
from rlx.types import RolloutBatch, Group, Sample, SampleStatus

pytestmark = pytest.mark.integration


def teachers_config(tmp_path, teachers, **more):
    return parse_config(json.dumps({
        "run": {"output_dir": str(tmp_path)}, "model": {"path": "builtin://tiny-qwen3"},
        "rollout": {"teachers": teachers, **more},
        "train": {"objective": {"distill": {"estimator": "top_k", "top_k": 3}}}}))


def sample(sid, prompt, response, mask, **metadata):
    return Sample(prompt_ids=prompt, response_ids=response, loss_mask=mask, rollout_logprobs=[-1.0] * len(response),
                  status=SampleStatus.COMPLETED, sample_id=sid, metadata=metadata)


def test_teachers_score_the_model_tokens_as_a_forward_pass_and_rows_pick_their_teacher(tiny_model_path, tmp_path):
    """One teacher launched (an embedded engine), another attached to it by address (rollout.teachers[*].urls); a
    plain sample, a multi-turn one (a tool's output, mask 0, in its response), a row naming no teacher, one naming
    a teacher that does not exist."""
    launched = teachers_config(tmp_path, [{"name": "a", "model_path": "builtin://tiny-qwen3",
                                           "server_args": {"num_threads": 1}}])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()

    async def go():
        first = Teachers(launched)
        await first.start()
        try:
            url = first.fleets["a"].engines[0].url
            both = Teachers(teachers_config(tmp_path, [{"name": "a", "urls": [url]}, {"name": "b", "urls": [url]}],
                                            teacher_field="teacher"))
            await both.start()
            try:
                plain = sample(0, [1, 264, 263], [201, 284, 324, 5], [1, 1, 1, 1], teacher="a")
                turns = sample(1, [1, 67], [85, 300, 301, 302, 40, 41], [1, 1, 0, 0, 1, 1], teacher="b")
                none = sample(2, [1, 67], [85], [1])
                unfinished = sample(3, [1, 67], [85], [1], teacher="a")
                unfinished.status = SampleStatus.ABORTED
                await both.score([plain, turns, none, unfinished])
                with pytest.raises(RLXError, match=r"a row's metadata 'teacher' is 'c', which is no teacher of "
                                                   r"rollout.teachers \(\['a', 'b'\]\)"):
                    await both.score([sample(4, [1], [2], [1], teacher="c")])
                with pytest.raises(RLXError, match=r"teacher 'a': a sample of 2101 tokens is longer than the "
                                                   r"teacher's context \(2048\)"):
                    await both.score([sample(5, [1] * 2100, [2], [1], teacher="a")])
                return plain, turns, none, unfinished
            finally:
                await both.stop()
        finally:
            await first.stop()

    plain, turns, none, unfinished = asyncio.run(go())
    assert none.teacher is None and unfinished.teacher is None
    assert (plain.teacher.name, turns.teacher.name) == ("a", "b")
    for s in (plain, turns):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)[len(s.prompt_ids) - 1:-1]
        assert s.teacher.logprobs == pytest.approx(logp.gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0].tolist(),
                                                   abs=1e-5)
        values, best = logp.topk(3)
        assert s.teacher.top_ids == best.tolist()
        assert [v for row in s.teacher.top_logprobs for v in row] == pytest.approx(values.flatten().tolist(), abs=1e-5)
    # the KL counts the model's 4 tokens of the multi-turn sample, not the tool's 2
    total, n = turns.teacher.reverse_kl(turns)
    assert n == 4 and total == pytest.approx(sum(-1.0 - lp for lp, m in zip(turns.teacher.logprobs, turns.loss_mask)
                                                 if m))
    m = RolloutBatch(1, [Group(0, [plain, turns, none])]).sample_metrics()
    assert m["distill/b/reverse_kl"] == pytest.approx(total / 4)


def test_a_teacher_with_another_tokenizer_is_refused_at_start_and_its_engines_stop(tiny_model_path, tmp_path):
    """Preflight compares the folders it finds; a built-in or downloaded teacher is compared once its engines have
    it: here a copy of the student whose vocabulary swaps two ids."""
    from rlx.testing.models import other_tokenizer

    other = other_tokenizer(tiny_model_path, tmp_path / "other")
    teachers = Teachers(teachers_config(tmp_path, [{"name": "t", "model_path": str(other),
                                                    "server_args": {"num_threads": 1}}]))
    with pytest.raises(RLXError, match=r"rollout.teachers\[0\].model_path: teacher 't' .* has another tokenizer than "
                                       r"the student .*4 vocabulary entries differ"):
        asyncio.run(teachers.start())
    assert teachers.fleets["t"].engines == []  # stopped


def test_rl_train_distils_with_the_top_k_estimator(tiny_model_path, tmp_path):
    """`rl train` (no Ray) with a teacher beside the task reward: each step reports the teacher's sampled-token KL
    (rollout) and the top-k KL in the loss (trainer), and the loss is the policy loss plus that term."""
    import subprocess
    import sys

    cfg = small_run_config(tmp_path, "run", rollout={
        "teachers": [{"name": "arith", "model_path": "builtin://tiny-qwen3-arith", "server_args": {"num_threads": 1}}]},
        train={"num_steps": 2, "objective": {"distill": {"estimator": "top_k", "top_k": 4, "coef": 0.5}}},
        ray={"enabled": False})
    p = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["distill/arith/reverse_kl"] == r["distill/reverse_kl"] and r["distill/reverse_kl"] != 0
        assert r["distill_topk_kl"] > 0
        assert r["loss"] == pytest.approx(r["pg_loss"] + 0.5 * r["distill_topk_kl"], rel=1e-4, abs=1e-6)
    assert (tmp_path / "run" / "logs" / "teacher-arith" / "engine-arith-0.log").exists()

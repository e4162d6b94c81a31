"""The critic learns what it can see: a reward fixed by the first response token is predicted at every later
token, and not at the first (whose value is of the state before it, the prompt alone)."""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from rlx.config import parse_config
    from rlx.plugins import build_plugins
    from rlx.train.trainer import Trainer
    from rlx.types import Group, RolloutBatch, Sample, SampleStatus

    cfg = parse_config(json.dumps({"model": {"path": "builtin://tiny-qwen3"}, "train": {
        "objective": {"advantage": {"name": "gae", "args": {"lam": 1.0}}},
        "critic": {"optim": {"lr": 3e-3}, "warmup_steps": 1000, "value_clip": None}}}))
    trainer = Trainer(cfg, build_plugins())
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 500, (5,), generator=g).tolist()
    ev = []
    for step in range(1, 41):
        samples = []
        for sid in range(32):  # reward 1 when the first response token is 10, 0 when it is 11; 6 tokens each
            first = 10 + int(torch.randint(0, 2, (1,), generator=g))
            resp = [first] + torch.randint(3, 500, (5,), generator=g).tolist()
            samples.append(Sample(prompt, resp, [1] * 6, [-6.2] * 6, reward=float(first == 10),
                                  status=SampleStatus.COMPLETED, sample_id=sid, group_id=sid // 4))
        groups = [Group(i, samples[4 * i:4 * i + 4]) for i in range(8)]
        m = trainer.train_step(RolloutBatch(step, groups))
        ev.append(m["critic/explained_variance"])
    print(json.dumps(ev))
""")


def test_the_critic_predicts_a_reward_from_the_tokens_before_each_position(tiny_model_path, tmp_path):
    script = tmp_path / "critic.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ev = json.loads(r.stdout.strip().splitlines()[-1])
    assert abs(ev[0]) < 1e-6  # the value head starts at 0: nothing explained
    # Returns are the reward at every token (gamma = lam = 1). The values at tokens 2..6 can see the first
    # token, the value at token 1 cannot: at best 5 of the 6 tokens' variance is explained. Values one
    # position off would explain all of it (or none).
    late = sum(ev[-5:]) / 5
    assert 0.75 < late < 0.86, ev


HEADS = textwrap.dedent("""
    import json, warnings
    warnings.filterwarnings("ignore")
    import torch
    from rlx.config import parse_config
    from rlx.plugins import build_plugins
    from rlx.train.trainer import Trainer
    from rlx.types import Group, RolloutBatch, Sample, SampleStatus

    cfg = parse_config(json.dumps({"model": {"path": "builtin://tiny-qwen3"}, "train": {
        "objective": {"advantage": "gae"}, "max_tokens_per_micro_batch": 64, "row_tokens": 24}}))
    trainer = Trainer(cfg, build_plugins())
    seen = {"actor": [], "critic": []}
    for name, role in (("actor", trainer.actor), ("critic", trainer.critic)):
        role.model.output_layer.register_forward_hook(
            lambda m, args, out, n=name: seen[n].append((tuple(args[0].shape), tuple(out[0].shape))))
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(3, 500, (9,), generator=g).tolist(), torch.randint(3, 500, (n,), generator=g).tolist(),
                      [1] * n, [-6.2] * n, reward=float(i % 2), status=SampleStatus.COMPLETED, sample_id=i,
                      group_id=i // 2) for i, n in enumerate([3, 7, 1, 12, 5, 4])]
    rows = max(len(mb.input_ids) for mb in trainer.step_fn.packed(samples))
    both = {}
    for selects in (True, False):  # the same log-probs and values whether the heads skip positions or not
        trainer.actor._selects = trainer.critic._selects = selects
        lp = trainer.step_fn.logprobs(trainer.actor, samples)
        vals = trainer.critic_step.values(samples)
        both[selects] = torch.cat([lp[i] for i in range(6)]), torch.cat([vals[i] for i in range(6)])
    diff = max((a - b).abs().max().item() for a, b in zip(both[True], both[False]))
    for role in seen.values():
        role.clear()
    trainer.actor._selects = trainer.critic._selects = True
    trainer.train_step(RolloutBatch(1, [Group(i, samples[2 * i:2 * i + 2]) for i in range(3)]))
    print("RESULT", json.dumps({"seen": seen, "rows": rows, "diff": diff}))
""")


def test_output_layers_run_only_where_a_token_is_predicted(tiny_model_path):
    """The LM head and the value head compute only the positions predicting response tokens (32 of the 86
    packed tokens here, packed into rows of 24), and give the same log-probs and values as computing every
    position: prompts and row padding cost no vocabulary-wide matmul."""
    r = subprocess.run([sys.executable, "-c", HEADS], capture_output=True, text=True, timeout=600)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, r.stderr[-3000:]
    got = json.loads(lines[0][len("RESULT "):])
    assert got["rows"] > 1 and got["diff"] < 1e-6, got
    for role, vocab in (("actor", 512), ("critic", 1)):
        shapes = got["seen"][role]
        assert shapes, role
        for (tokens, batch, hidden), (out_tokens, out_batch, out_width) in shapes:
            assert batch == out_batch == 1 and tokens == out_tokens and out_width == vocab, (role, shapes)
    # one training step: the critic's values, then its update, then the actor's update (a forward each)
    assert sum(t for (t, _, _), _ in got["seen"]["critic"]) == 2 * 32
    assert sum(t for (t, _, _), _ in got["seen"]["actor"]) == 32

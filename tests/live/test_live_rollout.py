"""Partial rollout against a live SGLang 0.5.23 server on the CPU: samples still running at a batch's boundary
are aborted there (SGLang's abort returns what they generated) and resumed from that prefix in a later batch."""

import asyncio
import json

import pytest

from rlx.config import parse_config
from rlx.tasks import arithmetic, write_jsonl
from rlx.plugins import build_plugins
from rlx.rollout.session import RolloutSession
from rlx.types import SampleStatus

pytestmark = [pytest.mark.integration, pytest.mark.live]


def test_partial_rollout_aborts_at_the_boundary_and_resumes_from_the_prefix(sglang_py, tiny_model_path, tmp_path):
    data = write_jsonl(arithmetic(64), tmp_path / "data.jsonl")
    cfg = parse_config(json.dumps({
        "run": {"output_dir": str(tmp_path / "run")}, "model": {"path": "builtin://tiny-qwen3"},
        "data": {"path": str(data)}, "ray": {"enabled": False},
        "rollout": {"n_prompts": 2, "n_samples_per_prompt": 2, "rewards": ["exact_match"], "partial_rollout": {"enabled": True, "over_sampling": 3.0},
                    "requests": {"max_concurrency": 12}, "sampling": {"max_new_tokens": 1500},
                    "engines": [{"backend": "sglang", "python": sglang_py}]}}))

    async def go():
        async with RolloutSession(cfg, build_plugins()) as s:
            b1 = await s.manager.next_batch(1)
            kept = [g.group_id for g in s.manager.pending]
            pending = {x.sample_id: list(x.response_ids) for g in s.manager.pending for x in g.samples
                       if x.status == SampleStatus.ABORTED}
            s.manager.rc.partial_rollout.over_sampling = 1.0  # from here on only the kept groups finish
            later = [await s.manager.next_batch(2), await s.manager.next_batch(3)]
            return b1, kept, pending, later, s.manager.pending

    b1, kept, pending, later, left = asyncio.run(go())
    assert len(b1.groups) == 2 and pending, "groups still running at the boundary were kept"
    assert sorted(g.group_id for b in later for g in b.groups) == sorted(kept) and not left
    resumed = {x.sample_id: x for b in later for x in b.samples if x.sample_id in pending}
    assert resumed.keys() == pending.keys()
    for sid, x in resumed.items():
        prefix = pending[sid]
        assert x.response_ids[: len(prefix)] == prefix and len(x.response_ids) >= len(prefix)
        assert len(x.rollout_logprobs) == len(x.response_ids) == len(x.loss_mask)
    print(f"partial rollout on SGLang: {len(pending)} samples aborted at the boundary with "
          f"{sum(map(len, pending.values()))} tokens, resumed to {sum(len(x.response_ids) for x in resumed.values())}")

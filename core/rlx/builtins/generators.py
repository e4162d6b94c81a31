"""The built-in single-turn generator: chat-templated prompt in, one completion out."""

from __future__ import annotations

from rlx import hookimpl
from rlx.hookspecs import RegisterGenerators
from rlx.protocols import Generation
from rlx.rollout.context import append_model_tokens
from rlx.types import Sample, SampleStatus


class SingleTurn:
    """One generate call per sample; resumes a partial rollout from the tokens it already has."""

    name = "single_turn"

    async def generate(self, ctx: Generation, sample: Sample) -> list[Sample]:
        params = ctx.sampling_params(already=len(sample.response_ids))
        if params["max_new_tokens"] == 0:
            sample.status = SampleStatus.TRUNCATED
            return [sample]
        res = await ctx.generate(sample.prompt_ids + sample.response_ids, params, ctx.new_rid(sample))
        append_model_tokens(sample, res)
        # Text for rewards and people only: decoded from the ids, never the other way round.
        sample.response_text = ctx.tokenizer.decode(
            [t for t in sample.response_ids if t not in ctx.sampling.stop_token_ids], skip_special_tokens=True
        )
        if res.finish_reason == "stop" and isinstance(res.matched_stop, str):
            cut = sample.response_text.find(res.matched_stop)
            sample.response_text = sample.response_text[:cut] if cut >= 0 else sample.response_text
        return [sample]


@hookimpl
def register_generators(register: RegisterGenerators) -> None:
    register(SingleTurn)

"""The rollout buffer service: external agent frameworks POST finished trajectories for training.

``rollout.source: buffer`` makes the run train on what arrives at ``POST /rlx/trajectories`` (on
127.0.0.1, ``rollout.buffer.port``, bearer key ``rollout.buffer.api_key`` or a random one, printed)
instead of generating from a dataset; the engines still run, behind the router, for the external
framework to generate with, and still receive every weight update.

One POST is one group (the samples of one prompt that advantages compare):

    {"trajectories": [
        {"prompt_ids": [...], "response_ids": [...], "loss_mask": [...], "rollout_logprobs": [...],
         "temperature": 0.7, "reward": 1.0, "weight_version": 3, "id": "run7-42-0"},  # tokens, as sampled
        {"messages": [...], "tools": [...], "reward": 0.0}            # or chat messages
     ], "metadata": {...}}

``id`` (optional, a string) is the client's name for a trajectory: one already received (in this run,
checkpoints included) or twice in one POST rejects the POST, so a retried POST never trains twice. A
field the schema does not have (``lossmask``) rejects the POST naming it, never silently defaults; so do
a body over ``rollout.buffer.max_body_mb`` (413) and metadata over ``rollout.buffer.max_metadata_kb``
(metadata is kept in checkpoints until its group trains).

Token trajectories are taken as they are (token-in-token-out). Message trajectories are rendered with
the chat template, loss mask 1 on the assistant turns; that re-tokenises text, so those samples are
marked ``retokenized`` in their metadata. ``rollout_logprobs`` (optional) are the sampler's log-probs at
``temperature`` (default 1); without them a sample gets no importance correction (never made-up zeros),
and the run's metrics count such samples. Every trajectory is validated (ids in the vocabulary,
aligned lengths, a 0/1 mask with at least one 1, a finite reward, roles, the model's context length);
a bad one rejects the whole POST with 400 and a reason naming the field. Valid groups then go through
the same group filters as generated ones; a filtered group is answered 200 with ``queued: false`` and
why. Queued groups are trained in arrival order and saved in checkpoints until trained.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from rlx.config import Config
from rlx.http import bearer_key, serve_local
from rlx.types import Group, RolloutBatch, Sample, SampleStatus

if TYPE_CHECKING:
    from rlx.plugins import Plugins
    from rlx.types import JSON, Tokenizer


class Rejected(Exception):
    pass


TOKEN_FIELDS = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "temperature", "reward",
                "weight_version", "id")
MESSAGE_FIELDS = ("messages", "tools", "reward", "id")


def _unknown(given: dict, known: tuple[str, ...], where: str) -> None:
    import difflib

    extra = [k for k in given if k not in known]
    if extra:
        hints = []
        for k in extra:
            close = difflib.get_close_matches(k, known, n=1, cutoff=0.6)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise Rejected(f"{where}: unknown field(s) {', '.join(hints)}; the fields are {', '.join(known)}")


class TrajectoryBuffer:
    def __init__(self, cfg: Config, tokenizer: Tokenizer, plugins: Plugins, max_len: int | None = None):
        self.cfg = cfg
        self.tok = tokenizer
        self.plugins = plugins
        self.vocab = len(tokenizer)
        self.max_len = max_len
        self.api_key = cfg.rollout.buffer.api_key or f"rlx-b-{secrets.token_hex(16)}"
        self.queue: asyncio.Queue[Group] = asyncio.Queue()
        self.next_group_id = 0
        self.next_sample_id = 0
        self.counts = {"accepted": 0, "rejected": 0, "filtered": 0}
        self.seen_ids: set[str] = set()  # trajectory ids received (kept in checkpoints)
        self.runner: web.AppRunner | None = None
        self.url = ""

    # -- server ----------------------------------------------------------------------------------

    async def start(self) -> str:
        app = web.Application(client_max_size=int(self.cfg.rollout.buffer.max_body_mb * 2**20))
        app.router.add_post("/rlx/trajectories", self.post)
        app.router.add_get("/rlx/trajectories/stats", self.stats)
        self.runner, self.url = await serve_local(app, "127.0.0.1", self.cfg.rollout.buffer.port)
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def _authorised(self, request: web.Request) -> bool:
        return secrets.compare_digest(bearer_key(request), self.api_key)

    async def stats(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"error": "missing or invalid API key"}, status=401)
        return web.json_response({**self.counts, "queued": self.queue.qsize()})

    async def post(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"error": "missing or invalid API key"}, status=401)
        try:
            try:
                body = await request.json()
            except ValueError as e:
                raise Rejected(f"the body is not valid JSON: {e}") from None
            group = self.to_group(body)
        except Rejected as e:
            self.counts["rejected"] += 1
            return web.json_response({"queued": False, "error": str(e)}, status=400)
        if not self.keep(group):
            self.counts["filtered"] += 1
            return web.json_response({"queued": False, "reason": group.metadata.get("filtered", "filtered")})
        self.queue.put_nowait(group)
        self.counts["accepted"] += 1
        return web.json_response({"queued": True, "group_id": group.group_id,
                                  "sample_ids": [s.sample_id for s in group.samples]})

    # -- validation ------------------------------------------------------------------------------

    def to_group(self, body: JSON) -> Group:
        if not isinstance(body, dict) or not isinstance(body.get("trajectories"), list) or not body["trajectories"]:
            raise Rejected("trajectories: a non-empty list is required")
        _unknown(body, ("trajectories", "metadata"), "the body")
        meta = body.get("metadata") or {}
        if not isinstance(meta, dict):
            raise Rejected("metadata: must be an object")
        size = len(json.dumps(meta))
        limit = self.cfg.rollout.buffer.max_metadata_kb * 1024
        if size > limit:
            raise Rejected(f"metadata: {size / 1024:.0f} KB, over rollout.buffer.max_metadata_kb "
                           f"({self.cfg.rollout.buffer.max_metadata_kb:g} KB; metadata is kept in checkpoints)")
        samples = [self.to_sample(t, f"trajectories[{i}]") for i, t in enumerate(body["trajectories"])]
        ids = [s.metadata["client_id"] for s in samples if "client_id" in s.metadata]
        for i, s in enumerate(samples):
            tid = s.metadata.get("client_id")
            if tid is not None and (tid in self.seen_ids or ids.count(tid) > 1):
                again = "was already received" if tid in self.seen_ids else "appears twice in this POST"
                raise Rejected(f"trajectories[{i}].id: {tid!r} {again}")
        self.seen_ids.update(ids)
        gid = self.next_group_id
        self.next_group_id += 1
        for i, s in enumerate(samples):
            s.group_id, s.index, s.sample_id = gid, i, self.next_sample_id
            s.metadata.update(meta)
            self.next_sample_id += 1
        return Group(gid, samples, metadata={"received": time.time()})

    def to_sample(self, t: JSON, where: str) -> Sample:
        if not isinstance(t, dict):
            raise Rejected(f"{where}: must be an object")
        _unknown(t, MESSAGE_FIELDS if "messages" in t else TOKEN_FIELDS, where)
        reward = t.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise Rejected(f"{where}.reward: a finite number is required")
        tid = t.get("id")
        if tid is not None and (not isinstance(tid, str) or not 0 < len(tid) <= 256):
            raise Rejected(f"{where}.id: a string of 1 to 256 characters")
        if "messages" in t:
            s = self._from_messages(t, where)
        else:
            s = self._from_tokens(t, where)
        if tid is not None:
            s.metadata["client_id"] = tid
        if not any(s.loss_mask):
            raise Rejected(f"{where}.loss_mask: no token has mask 1, nothing to train on")
        if self.max_len is not None and s.total_len > self.max_len:
            raise Rejected(f"{where}: {s.total_len} tokens, longer than the model's {self.max_len}")
        s.reward = float(reward)
        s.status = SampleStatus.COMPLETED
        return s

    def _ids(self, value: JSON, where: str) -> list[int]:
        if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise Rejected(f"{where}: a list of token ids is required")
        bad = [x for x in value if not 0 <= x < self.vocab]
        if bad:
            raise Rejected(f"{where}: id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})")
        return list(value)

    def _from_tokens(self, t: dict, where: str) -> Sample:
        prompt = self._ids(t.get("prompt_ids"), f"{where}.prompt_ids")
        resp = self._ids(t.get("response_ids"), f"{where}.response_ids")
        if not prompt or not resp:
            raise Rejected(f"{where}: prompt_ids and response_ids must not be empty")
        mask = t.get("loss_mask", [1] * len(resp))
        if not isinstance(mask, list) or any(m not in (0, 1) or isinstance(m, bool) for m in mask):
            raise Rejected(f"{where}.loss_mask: a list of 0 and 1 is required")
        if len(mask) != len(resp):
            raise Rejected(f"{where}.loss_mask: {len(mask)} entries for {len(resp)} response ids")
        lps = t.get("rollout_logprobs")
        if lps is not None and (not isinstance(lps, list) or len(lps) != len(resp) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x <= 0 for x in lps)):
            raise Rejected(f"{where}.rollout_logprobs: {len(resp)} finite log-probs (<= 0) are required")
        version = t.get("weight_version", 0)
        if not isinstance(version, int) or isinstance(version, bool):
            raise Rejected(f"{where}.weight_version: an integer is required")
        temperature = t.get("temperature", 1.0)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 10:
            raise Rejected(f"{where}.temperature: the sampling temperature, a number from 0 to 10")
        s = Sample(prompt_ids=prompt, response_ids=resp, loss_mask=list(mask),
                   rollout_logprobs=[float(x) for x in lps] if lps is not None else None,
                   token_temperatures=[float(temperature) if temperature > 0 else 1.0] * len(resp),
                   weight_version=version, token_versions=[version] * len(resp))
        s.metadata["external"] = True
        s.response_text = self.tok.decode([x for x, m in zip(resp, mask) if m], skip_special_tokens=True)
        return s

    def _from_messages(self, t: dict, where: str) -> Sample:
        msgs = t["messages"]
        tools = t.get("tools")
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and m.get("role") in
                                                 ("system", "user", "assistant", "tool") for m in msgs):
            raise Rejected(f"{where}.messages: a list of messages with role system, user, assistant or tool")
        first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
        if first is None or first == 0:
            raise Rejected(f"{where}.messages: needs a prompt and at least one assistant message after it")
        try:
            prompt, resp, mask = self._render(msgs, tools, first, where)
        except Rejected:
            raise
        except Exception as e:
            raise Rejected(f"{where}.messages: the chat template failed: {e}") from None
        s = Sample(prompt_ids=prompt, response_ids=resp, loss_mask=mask, rollout_logprobs=None,
                   token_versions=[0] * len(resp))
        s.metadata.update(external=True, retokenized=True)
        s.response_text = self.tok.decode([x for x, m in zip(resp, mask) if m], skip_special_tokens=True)
        return s

    def _render(self, msgs: list[dict], tools: JSON, first: int, where: str) -> tuple[list[int], list[int], list[int]]:
        """Prompt ids, then each later message's tokens in turn: mask 1 on an assistant turn up to and
        including its stop token, 0 on everything the template or other roles add."""

        def render(ms: list[dict], gen: bool) -> str:
            return self.tok.apply_chat_template(ms, tools=tools, add_generation_prompt=gen, tokenize=False)

        def enc(text: str) -> list[int]:
            return self.tok.encode(text, add_special_tokens=False)

        done = render(msgs[:first], True)
        prompt, resp, mask = enc(done), [], []
        for k in range(first, len(msgs)):
            steps = [(render(msgs[:k], True), 0)] if msgs[k]["role"] == "assistant" and k > first else []
            steps.append((render(msgs[:k + 1], False), 1 if msgs[k]["role"] == "assistant" else 0))
            for text, model in steps:
                if not text.startswith(done):
                    raise Rejected(f"{where}.messages[{k}]: the chat template does not render this conversation "
                                   f"incrementally; send tokens instead")
                piece = enc(text[len(done):])
                m = [model] * len(piece)
                if model and self.tok.eos_token_id in piece:  # what follows the stop token is the template's
                    last = len(piece) - 1 - piece[::-1].index(self.tok.eos_token_id)
                    m = [1] * (last + 1) + [0] * (len(piece) - last - 1)
                resp += piece
                mask += m
                done = text
        return prompt, resp, mask

    def keep(self, group: Group) -> bool:
        if self.cfg.rollout.dynamic_sampling.filter_zero_variance and len({s.reward for s in group.samples}) <= 1:
            group.metadata["filtered"] = ("filtered: every trajectory has the same reward "
                                          "(rollout.dynamic_sampling.filter_zero_variance)")
            return False
        if not self.plugins.keep_group(group):
            group.metadata["filtered"] = "filtered by a plugin's filter_group"
            return False
        return True


class BufferBatches:
    """Batches of `n_prompts` groups from the buffer, in arrival order (the loop's batch source)."""

    def __init__(self, cfg: Config, buffer: TrajectoryBuffer, fleet: Any, announce=None):  # fleet: the run's engines
        self.cfg = cfg
        self.buffer = buffer
        self.fleet = fleet
        self.announce = announce
        self.restored: list[Group] = []
        self.taken: list[Group] = []  # groups handed out since the last checkpoint (for `rewind`)

    def start(self) -> None:
        pass

    async def open(self) -> None:
        url = await self.buffer.start()
        if self.announce is not None:
            self.announce(f"rollout buffer: POST {url}/rlx/trajectories (Authorization: Bearer "
                          f"{self.buffer.api_key}); engines at {self.fleet.url}")

    async def next_batch(self, step: int, version: int) -> RolloutBatch:
        t0 = time.monotonic()
        groups: list[Group] = []
        while len(groups) < self.cfg.rollout.n_prompts:
            groups.append(self.restored.pop(0) if self.restored else await self.buffer.queue.get())
        self.taken += groups
        batch = RolloutBatch(step, groups, version)
        rewards = [s.reward for g in groups for s in g.samples if s.reward is not None]  # all: the buffer needs one
        lens = [len(s.response_ids) for g in groups for s in g.samples]
        batch.metrics.update({"reward/mean": sum(rewards) / len(rewards), "response_len/mean": sum(lens) / len(lens),
                              "rollout/groups": float(len(groups)), "rollout/samples": float(len(rewards)),
                              "buffer/queued": float(self.buffer.queue.qsize()),
                              "buffer/rejected": float(self.buffer.counts["rejected"]),
                              "buffer/filtered": float(self.buffer.counts["filtered"]),
                              "time/rollout_s": time.monotonic() - t0})
        return batch

    async def before_train(self) -> None:
        pass

    async def after_train(self) -> None:
        pass

    async def swap(self, push) -> None:
        await push()

    async def state_dict(self) -> dict[str, Any]:
        queued = self.restored + list(self.buffer.queue._queue)  # type: ignore[attr-defined]  # a snapshot, not consumed
        self.taken = []
        return {"next_group_id": self.buffer.next_group_id, "next_sample_id": self.buffer.next_sample_id,
                "queued": [g.to_dict() for g in queued], "seen_ids": sorted(self.buffer.seen_ids)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.next_group_id = state["next_group_id"]
        self.buffer.next_sample_id = state["next_sample_id"]
        self.restored = [Group.from_dict(g) for g in state["queued"]]
        self.buffer.seen_ids = set(state.get("seen_ids", []))

    async def rewind(self, state: dict[str, Any]) -> None:
        """Back to the last checkpoint: the groups trained since are served again first (ids and what arrived
        since stay as they are: clients may have been told those ids)."""
        self.restored = self.taken + self.restored
        self.taken = []

    async def close(self) -> None:
        await self.buffer.stop()

"""Continuous batching over a Hugging Face causal LM: the embedded engine's core, run in one thread.

Choices:

* Any ``AutoModelForCausalLM`` works: the model is called with a left-padded batch, a 2-D attention
  mask, explicit per-row position ids and one ``DynamicCache`` for the whole running batch.
* Requests that arrive while others decode are prefilled together, then merged into the running batch
  by left-padding the two caches to a common length; finished rows are dropped by index, and leading
  columns that no row uses any more are trimmed, so padding does not accumulate.
* A prompt runs only the ids after the longest prefix the prefix cache holds for it, in the same forward as
  the other new prompts (RL prompts share a chat template's head: nearly all of them hit the cache for a few
  ids); prompts whose uncached parts differ much in length take separate forwards.
* Sampling is vectorised over rows, each row with its own temperature, top-p, top-k and min-p.
  The logprob reported for a token is ``log_softmax(logits / temperature)`` at that token, before top-k
  or top-p truncation (SGLang's default), and the plain ``log_softmax(logits)`` when greedy; with
  temperature 1 it is exactly the model's logprob, which is what RL needs.
* Output ids include the stop token that ended a request (EOS or a stop id), so a trainer learns to
  stop; the text excludes it and is cut before a matched stop string.
* Commands (weight updates, flush, pause) run in this thread between two decode steps, so a step
  never sees half-updated weights. Each output token records the weight version that produced it.
* Speculative decoding (`speculative` > 0 drafts a step): a decode step feeds each row its last token and its
  drafts, verifies them by rejection sampling against the target's logits (`sampling.verify`: the tokens follow
  plain sampling's distribution, greedy ones are the same, the logprobs are the target's), and keeps the KV of
  the tokens taken: each row's columns are shifted right by what it refused, so rows stay right-aligned. Drafts
  are n-gram lookups in the row's own tokens (`speculative.ngram_draft`), or a draft model's samples: a smaller
  model with the same tokenizer whose KV is kept beside the target's, column for column (it is prefilled with
  the prompts, runs the same tokens, and loses the same refused columns). A step whose drafts fill less than half of the positions
  the batch would run (every row runs the longest draft's) decodes as without: on a CPU a verify forward costs
  about a token's forward per position, which padding never pays back.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from rlx.rollout.engines.embedded.logprobs import extras, score_prompt
from rlx.rollout.engines.embedded.mtp import mask as mtp_mask
from rlx.rollout.engines.embedded.routing import RoutedExperts
from rlx.rollout.engines.embedded.sampling import (SamplingParams, SamplingTensors, propose, sample, seeded_uniform,
                                                  verify)
from rlx.rollout.engines.embedded.speculative import ngram_draft

if TYPE_CHECKING:
    from rlx.rollout.engines.embedded.lora import Adapters
    from rlx.types import HFModel, KVCache, Tokenizer

log = logging.getLogger(__name__)

_rid_counter = itertools.count()


def _plain_layers(cache: KVCache) -> list[tuple[torch.Tensor, ...]]:
    """Per layer (keys, values) of a cache of full-attention layers only (a draft model's)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


@dataclass
class Request:
    input_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: f"req-{next(_rid_counter)}")
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    text: str = ""
    finish_reason: dict[str, Any] | None = None
    aborted: str | None = None  # the abort message, once asked to abort
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    routed: list[torch.Tensor] = field(default_factory=list)  # [tokens, layers, top_k] per forward, in order
    on_token: Callable[[Request], object] | None = None  # called in the scheduler thread
    on_done: Callable[[Request], object] | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    cached_tokens: int = 0  # prompt tokens this request did not prefill (prefix cache or a forked prompt)
    kv_epoch: int = 0  # the prefix cache's epoch when it was prefilled (its KV is from that epoch's weights)
    # what SGLang's return_logprob adds when asked: the prompt's log-probs from this index (-1: none), the top
    # log-probs of each position, the log-probs of these ids at each position; and what they came to
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_ids_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    output_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # speculative decoding, as SGLang counts it: verify forwards, drafts proposed and drafts taken
    spec_verify_ct: int = 0
    spec_proposed: int = 0
    spec_correct: int = 0
    lora: str | None = None  # the LoRA adapter it is generated with (SGLang's lora_path; None: the base model)
    lora_held: bool = False  # counted among its adapter's users (`lora.Adapters.hold`) until it finishes


    @property
    def scores_prompt(self) -> bool:
        """Whether it asks for its prompt's log-probs (which run the whole prompt, from no cached KV)."""
        return 0 <= self.logprob_start_len < len(self.input_ids)

    @property
    def per_token_extras(self) -> bool:
        return self.top_logprobs_num > 0 or self.token_ids_logprob is not None


@dataclass
class _Prompt:
    """The requests with one prompt, prefilled together, and the longest prefix of it the cache holds."""

    requests: list[Request]
    cached: int = 0  # ids the cache holds
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # their KV, [1, heads, >= cached, d]

    @property
    def ids(self) -> list[int]:
        return self.requests[0].input_ids

    @property
    def start(self) -> int | None:
        """The first position whose prompt log-probs a request asks for (None: none does)."""
        starts = [r.logprob_start_len for r in self.requests if r.scores_prompt]
        return min(starts) if starts else None

    @property
    def todo(self) -> int:
        return len(self.ids) - self.cached


# A forward computes every row as long as its longest. Prompts share one while the ids it computes beyond those
# they need (padding, and cached ids run again) are at most this fraction of those they need, or this many ids:
# a forward's fixed cost on CPU is about that of a dozen ids of a 135M model.
PREFILL_SLACK = 0.25
PREFILL_SLACK_IDS = 16


def _chunks(prompts: list[_Prompt]) -> list[list[_Prompt]]:
    """Group prompts into forwards by the length of their uncached parts, longest first; each group keeps the
    prompts' arrival order."""
    order = sorted(range(len(prompts)), key=lambda i: -prompts[i].todo)
    groups: list[list[int]] = []
    need = 0
    for i in order:
        todo = prompts[i].todo
        if groups and ((len(groups[-1]) + 1) * prompts[groups[-1][0]].todo - (need + todo)
                       <= max(PREFILL_SLACK * (need + todo), PREFILL_SLACK_IDS)):
            groups[-1].append(i)
            need += todo
        else:
            groups.append([i])
            need = todo
    return [[prompts[i] for i in sorted(g)] for g in groups]


def abort_reason(message: str, status_code: int | None = None, err_type: str | None = None) -> dict[str, Any]:
    """SGLang's ``finish_reason`` of an aborted request."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


class Command:
    """A function to run in the scheduler thread between steps, with a result to wait for."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # handed to the caller, who reports it
            self.error = e
        finally:
            self.done.set()


class Scheduler:
    """Owns the model and the running batch; everything that touches them runs in its thread."""

    def __init__(self, model: HFModel, tokenizer: Tokenizer, *, max_running: int = 64, seed: int = 0,
                 max_context: int | None = None, capture_experts: bool = False, prefix_cache_tokens: int = 0,
                 prefix_cache_bytes: int = 0, speculative: int = 0, draft: HFModel | None = None, mtp: bool = False,
                 adapters: Adapters | None = None):
        """`speculative`: drafts verified per decode step (0: none; SGLang's ``--speculative-num-draft-tokens`` less
        one), by n-gram lookup, drawn from `draft` (a model with the target's tokenizer), or with `mtp` from the
        model's own multi-token-prediction layer (`mtp.MTPDraft`). `capture_experts`: record the experts each token is routed to (SGLang's
        ``--enable-return-routed-experts``), for requests that ask (`Request.return_routed_experts`).
        The prefix cache's budget (`prefix.PrefixCache`): `prefix_cache_tokens` tokens, or else as many tokens as
        `prefix_cache_bytes` of this model's KV hold (sized at the first entry); neither: no cache. `adapters`: the LoRA
        adapters requests may name (SGLang's ``--enable-lora``; their prompts skip the prefix cache)."""
        from rlx.rollout.engines.embedded.prefix import PrefixCache

        self.model = model
        self.adapters = adapters
        self.experts = RoutedExperts(model) if capture_experts else None
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_running = max_running
        self.max_context: int = max_context or getattr(model.config, "max_position_embeddings", None) or 1 << 30
        eos = getattr(model.config, "eos_token_id", None) or tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.weight_version = "0"
        self.paused = False
        self.released = False
        self.inbox: queue.Queue[Request | Command] = queue.Queue()
        self.waiting: list[Request] = []
        self.rows: list[Request] = []
        # the running batch, one row per request in `rows` (empty tensors when no row runs)
        self._cache: KVCache = None  # transformers' cache of the running rows (None when no row runs)
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # [B, L] 1 where a real token sits
        self._pos = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] position id of the next token
        self._last = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] last sampled token
        self._sampling: SamplingTensors | None = None  # for the current rows; None when they change
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="rlx-engine-scheduler", daemon=True)
        self.steps = 0
        self.prefill_batches = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0  # prompt tokens of admitted requests
        self.cached_tokens = 0  # of those, not prefilled (prefix cache hits and forked prompts)
        budget = prefix_cache_tokens if prefix_cache_tokens > 0 else (1 << 62 if prefix_cache_bytes > 0 else 0)
        self.prefix = PrefixCache(budget) if budget > 0 else None
        self._prefix_bytes = prefix_cache_bytes if prefix_cache_tokens <= 0 else 0  # to size it by, once
        self.kv_epoch = 0  # advances when the weights change: KV from before is not this model's
        # linear-attention layers (Qwen3-Next's GDN) keep a convolution window and a recurrent state per row instead
        # of per-token keys and values: rows are selected and joined the same way, but never padded or trimmed
        types = getattr(model.config.get_text_config(), "layer_types", None) or []
        self.recurrent = [t == "linear_attention" for t in types]
        # sparse-attention layers (DeepSeek-V3.2's, GLM-5's) keep their indexer's keys beside the keys and values:
        # one more tensor per token column, selected, padded and joined with them
        self.indexed = any(type(layer).__name__ == "DynamicIndexedLayer"
                           for layer in DynamicCache(config=model.config).layers)
        self.speculative = speculative
        self.draft = draft
        self.mtp = None
        if mtp:
            from rlx.rollout.engines.embedded.mtp import MTPDraft

            self.mtp = MTPDraft(model)
        self._dcache: KVCache = None  # the draft model's or MTP layer's KV of the running rows, in the target's columns
        # with MTP drafts: the target's final hidden state at each row's last column (the next draft's input)
        self._hid = torch.zeros((0, model.config.get_text_config().hidden_size), device=self.device,
                                dtype=next(model.parameters()).dtype)
        if draft is not None and not self._cacheable(DynamicCache(config=draft.config)):
            raise ValueError(f"speculative decoding: the draft model ({draft.config.model_type}) has layers other "
                             f"than full attention, whose state the engine cannot keep beside the target's")
        if speculative and any(self.recurrent):
            raise ValueError(f"speculative decoding: {model.config.model_type} has linear-attention layers, whose "
                             f"recurrent state cannot take back refused drafts")
        self.spec_verify_ct = self.spec_proposed = self.spec_correct = 0
        if self.mtp is not None and self.prefix is not None:
            log.info("prefix cache off: MTP drafts need the target's hidden state at every prompt position")
            self.prefix, self._prefix_bytes = None, 0
        if (any(self.recurrent) or self.indexed) and self.prefix is not None:
            log.info("prefix cache off: %s has linear-attention or sparse-attention layers (a prefix's state is not "
                     "its keys and values alone)", model.config.model_type)
            self.prefix, self._prefix_bytes = None, 0

    # -- called from other threads -------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self.inbox.put(Command(lambda: None))
        self.thread.join(timeout=10)

    def submit(self, req: Request) -> None:
        self.inbox.put(req)

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run `fn` in the scheduler thread between steps and return its result (blocking)."""
        cmd = Command(fn)
        self.inbox.put(cmd)
        if not cmd.done.wait(timeout):
            raise TimeoutError("the engine did not run the command in time")
        if cmd.error is not None:
            raise cmd.error
        return cmd.result

    def abort(self, rid: str | None = None, message: str = "aborted") -> int:
        """Mark requests to abort (all when rid is None); they finish at the next step boundary."""
        return self.call(lambda: self._abort(rid, message))

    # -- the scheduler thread ------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            idle = not self.rows and not self.waiting or self.paused or self.released
            self._drain_inbox(block=idle)
            if self._stop.is_set():
                break
            self._finish_aborted()
            if self.paused or self.released:
                continue
            new: list[Request] = []
            try:
                room = self.max_running - len(self.rows)
                if room > 0 and self.waiting:
                    new, self.waiting = self.waiting[:room], self.waiting[room:]
                    self._prefill(new)
                if self.rows:
                    self._decode()
            except Exception as e:  # a model error fails the requests in flight (prefilling ones too), not the server
                prefilling = [r for r in new if r not in self.rows]
                # a request that finished before the error keeps its own finish
                for r in [r for r in self.rows + prefilling + self.waiting if r.finish_reason is None]:
                    self._finish(r, abort_reason(f"engine error: {type(e).__name__}: {e}", 500,
                                                 "InternalServerError"))
                self._reset_batch()
                self.waiting = []

    def _drain_inbox(self, block: bool) -> None:
        first = True
        while True:
            try:
                item = self.inbox.get(block=block and first, timeout=0.5 if block and first else None)
            except queue.Empty:
                return
            first = False
            if isinstance(item, Command):
                item.run()
            else:
                self._admit(item)

    def _admit(self, req: Request) -> None:
        p = req.params
        if req.lora is not None and not (self.adapters is not None and self.adapters.hold(req.lora)):
            self._finish(req, abort_reason(f"LoRA adapter {req.lora} is not loaded", 400, "BadRequestError"))
            return
        req.lora_held = req.lora is not None
        if len(req.input_ids) + 1 > self.max_context:
            self._finish(req, {"type": "length", "length": len(req.input_ids)})
        elif p.max_new_tokens <= 0 and not (req.scores_prompt or req.per_token_extras):
            self._finish(req, {"type": "length", "length": 0})
        else:
            self.waiting.append(req)

    def _abort(self, rid: str | None, message: str) -> int:
        n = 0
        for r in self.rows + self.waiting:
            if rid is None or r.rid.startswith(rid):  # SGLang matches by prefix
                r.aborted = message
                n += 1
        self._finish_aborted()
        return n

    def _finish_aborted(self) -> None:
        for r in list(self.waiting):
            if r.aborted:
                self.waiting.remove(r)
                self._finish(r, abort_reason(r.aborted))
        keep = [i for i, r in enumerate(self.rows) if not r.aborted]
        if len(keep) != len(self.rows):
            for r in self.rows:
                if r.aborted:
                    self._finish(r, abort_reason(r.aborted))
            self._select(keep)

    # -- batch state ---------------------------------------------------------------------------

    def _reset_batch(self) -> None:
        self.rows, self._cache, self._dcache, self._sampling = [], None, None, None
        self._hid = self._hid.new_zeros((0, self._hid.shape[1]))
        self._mask, self._pos, self._last = self._mask.new_zeros((0, 0)), self._pos.new_zeros(0), self._last.new_zeros(0)

    def _layers(self, cache: KVCache) -> list[tuple[torch.Tensor, ...]]:
        """Per layer: (keys, values) ``[B, heads, L, d]``, with a sparse-attention layer's indexer keys as a third
        ``[B, 1, L, d]``; or for a linear-attention layer (convolution window ``[B, channels, width]``, recurrent
        state ``[B, heads, dk, dv]``)."""
        out: list[tuple[torch.Tensor, ...]] = []
        for layer, rec in zip(cache.layers, self.recurrent or [False] * len(cache.layers)):
            if rec:
                out.append((layer.conv_states[0], layer.recurrent_states[0]))
            elif getattr(layer, "is_indexer_initialized", False):
                out.append((layer.keys, layer.values, layer.indexer_keys[:, None]))
            else:
                out.append((layer.keys, layer.values))
        return out

    def _make_cache(self, kv: list[tuple[torch.Tensor, ...]]) -> Any:
        if not any(self.recurrent) and not self.indexed:
            return DynamicCache(ddp_cache_data=kv)
        cache = DynamicCache(config=self.model.config)
        layers: list[Any] = cache.layers  # a union of layer kinds in transformers' types; `rec` says which this is
        for layer, rec, state in zip(layers, self.recurrent or [False] * len(layers), kv):
            if rec:  # owned tensors: decoding updates them in place
                a, b = state
                layer.lazy_initialization(conv_states=a, recurrent_states=b)
                layer.conv_states[0].copy_(a)
                layer.recurrent_states[0].copy_(b)
                layer.has_previous_state[0] = True
                continue
            layer.lazy_initialization(state[0], state[1])
            layer.keys, layer.values = state[0], state[1]
            if len(state) == 3:
                layer.lazy_initialization_indexer(state[2][:, 0])
                layer.indexer_keys = state[2][:, 0]
        return cache

    @property
    def _pad(self) -> int:
        return self.tokenizer.pad_token_id or 0

    def _columns(self, layer: int) -> bool:
        """Whether the layer's cache has a column per token (keys and values), which rows pad and trim."""
        return not (self.recurrent and self.recurrent[layer])

    def _select(self, keep: list[int]) -> None:
        if not keep:
            self._reset_batch()
            return
        idx = torch.tensor(keep, device=self.device)
        self.rows = [self.rows[i] for i in keep]
        self._sampling = None
        self._pos = self._pos.index_select(0, idx)
        self._last = self._last.index_select(0, idx)
        if self.mtp is not None:
            self._hid = self._hid.index_select(0, idx)
        self._set_columns(self._mask.index_select(0, idx),
                          *([tuple(t.index_select(0, idx) for t in state) for state in layers]
                            for layers in self._state()))

    def _state(self) -> list[list[tuple[torch.Tensor, ...]]]:
        """The running rows' per-layer state (`_layers`): the target's, and the draft model's when there is one."""
        out = [self._layers(self._cache)]
        if self._drafts_kv:
            out.append(_plain_layers(self._dcache))
        return out

    @property
    def _drafts_kv(self) -> bool:
        """Whether a draft model's or MTP layer's KV is kept beside the target's."""
        return self.draft is not None or self.mtp is not None

    def _set_columns(self, mask: torch.Tensor, kv: list[tuple[torch.Tensor, ...]],
                     draft: list[tuple[torch.Tensor, ...]] | None = None) -> None:
        """Make `mask`, `kv` and the draft model's `draft` the batch's, less the leading columns no row attends to
        (left padding of finished long rows, refused drafts)."""
        used = mask.any(0).nonzero()
        start = int(used[0]) if len(used) else mask.shape[1]
        self._cache = self._make_cache([tuple(t[:, :, start:] if self._columns(i) else t for t in state)
                                        for i, state in enumerate(kv)])
        if draft is not None:
            self._dcache = DynamicCache(ddp_cache_data=[(k[:, :, start:], v[:, :, start:]) for k, v in draft])
        self._mask = mask[:, start:]

    def _prefill(self, new: list[Request]) -> None:
        """Prefill new requests in as few forwards as padding allows. Each distinct prompt runs only the ids after
        the longest prefix the cache holds for it, and the n samples of a prompt fork one prompt's KV and logits.
        Prompts whose uncached parts have similar lengths share a forward (`_chunks`)."""
        by_ids: dict[tuple[Any, ...], list[Request]] = {}
        for r in new:
            r.kv_epoch = self.kv_epoch
            self.prompt_tokens += len(r.input_ids)
            # (requests that only score their prompt, max_new_tokens 0, are not merged into the batch)
            by_ids.setdefault((r.params.max_new_tokens <= 0, r.lora, *r.input_ids), []).append(r)
        prompts: list[_Prompt] = []
        for same in by_ids.values():
            # a request that wants its prompt's routing, or its log-probs, has the whole prompt run
            hit = (None if self.prefix is None or same[0].lora is not None
                   or any(r.return_routed_experts or r.scores_prompt for r in same)
                   else self.prefix.match(same[0].input_ids))
            prompts.append(_Prompt(same, *(hit or (0, []))))
        scoring = [p for p in prompts if p.start is not None or p.requests[0].params.max_new_tokens <= 0]
        for chunk in _chunks([p for p in prompts if p not in scoring]):
            self._prefill_chunk(chunk)
        for p in scoring:  # each alone: its forward keeps the logits of the positions it scores
            self._prefill_chunk([p])

    def _prefill_chunk(self, prompts: list[_Prompt]) -> None:
        """One forward over the prompts' last `run` ids each, `run` the longest uncached part among them, from the
        cached KV of the ids before (a prompt with a shorter uncached part runs again a few ids it has cached,
        rather than leaving a gap in its row). Rows are left-padded as everywhere in the running batch."""
        self.prefill_batches += 1
        n, run = len(prompts), max(p.todo for p in prompts)
        past = [max(len(p.ids) - run, 0) for p in prompts]  # cached ids each row takes, at most what it has
        width = max(past)
        ids = torch.full((n, run), self._pad, dtype=torch.long, device=self.device)
        pos = torch.zeros((n, run), dtype=torch.long, device=self.device)
        mask = torch.zeros((n, width + run), dtype=torch.long, device=self.device)
        for i, (p, k) in enumerate(zip(prompts, past, strict=True)):
            m = len(p.ids) - k
            ids[i, run - m:] = torch.tensor(p.ids[k:], device=self.device)
            pos[i, run - m:] = torch.arange(k, len(p.ids), device=self.device)
            mask[i, width + run - len(p.ids):] = 1
            for j, r in enumerate(p.requests):
                r.cached_tokens = k if j == 0 else len(p.ids)
                self.cached_tokens += r.cached_tokens
        cache = self._make_cache(self._left_padded(prompts, past, width) if width else [])
        experts = self._routing([r for p in prompts for r in p.requests])
        start = prompts[0].start if n == 1 else None  # (a prompt scored runs alone, whole: run = its length)
        keep: int | torch.Tensor = 1 if start is None else torch.arange(start, run, device=self.device)
        out = self._forward([p.requests[0].lora for p in prompts], input_ids=ids,
                            attention_mask=mask if bool((mask[:, 0] == 0).any()) else None, position_ids=pos,
                            past_key_values=cache, use_cache=True, logits_to_keep=keep)
        if n == 1 and (start is not None or prompts[0].requests[0].params.max_new_tokens <= 0):
            score_prompt(prompts[0].requests, prompts[0].ids, out.logits[0], run - 1 if start is None else start)
            if prompts[0].requests[0].params.max_new_tokens <= 0:  # scored only: done, never decoded
                if self.mtp is not None:
                    self.model.rlx_final_hidden = None
                for r in prompts[0].requests:
                    self._finish(r, {"type": "length", "length": 0})
                return
        for i, p in enumerate(prompts):
            if p.requests[0].lora is None:  # (the prefix cache holds the base model's KV)
                self._remember(p.ids, out.past_key_values, i, len(p.ids))
        cache, logits = out.past_key_values, out.logits[:, -1].float()
        taken = experts.take(n, run) if experts is not None else None
        draft, hid = self._draft_prefill(prompts, ids, pos, mask) if self._drafts_kv else (None, None)
        which = [i for i, p in enumerate(prompts) for _ in p.requests]
        if len(which) > n:  # fork each prompt's row to its requests
            idx = torch.tensor(which, device=self.device)
            cache = self._make_cache([tuple(t.index_select(0, idx) for t in state) for state in self._layers(cache)])
            hid = hid.index_select(0, idx) if hid is not None else None
            if draft is not None:
                draft = DynamicCache(ddp_cache_data=[(k.index_select(0, idx), v.index_select(0, idx))
                                                     for k, v in _plain_layers(draft)])
            logits, mask = logits.index_select(0, idx), mask.index_select(0, idx)
            taken = taken.index_select(0, idx) if taken is not None else None
        every = [r for p in prompts for r in p.requests]
        if taken is not None:
            for i, r in enumerate(every):
                if r.return_routed_experts:  # its prompt ran whole: no cached ids
                    r.routed.append(taken[i, run - len(r.input_ids):])
        self._merge(every, cache, mask, mask.sum(-1), draft, hid)
        offset = len(self.rows) - len(every)
        self._emit(logits, list(range(offset, len(self.rows))))

    def _draft_prefill(self, prompts: list[_Prompt], run_ids: torch.Tensor, run_pos: torch.Tensor,
                       mask: torch.Tensor) -> tuple[KVCache, torch.Tensor | None]:
        """The draft model's KV of the prompts, whole (it has no prefix cache), in the columns `mask` gives them;
        or the MTP layer's, from the target's hidden states of the prefill just run (whole prompts: MTP turns the
        prefix cache off), and each row's last hidden state."""
        if self.mtp is not None:
            hidden = self.mtp.hidden
            assert hidden is not None and hidden.shape[1] == run_ids.shape[1] == mask.shape[1]
            # column j holds x_j and the MTP entry of position j - 1: [x_j; h_{j-1}]
            before = torch.nn.functional.pad(hidden[:, :-1], (0, 0, 1, 0))
            _, _, cache = self.mtp(run_ids, before, mtp_mask(mask), run_pos - 1, None)
            self.model.rlx_final_hidden = None  # (read: not kept alive)
            return cache, hidden[:, -1]
        n, width = mask.shape
        ids = torch.full((n, width), self._pad, dtype=torch.long, device=self.device)
        pos = torch.zeros((n, width), dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, width - len(p.ids):] = torch.tensor(p.ids, device=self.device)
            pos[i, width - len(p.ids):] = torch.arange(len(p.ids), device=self.device)
        assert self.draft is not None
        return self.draft(input_ids=ids, attention_mask=mask if bool((mask[:, 0] == 0).any()) else None,
                          position_ids=pos, use_cache=True, logits_to_keep=1).past_key_values, None

    def _left_padded(self, prompts: list[_Prompt], past: list[int], width: int) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, the rows' first `past[i]` cached keys and values, left-padded to `width` columns."""
        layers: list[tuple[torch.Tensor, ...]] = []
        for layer in range(len(next(p.kv for p in prompts if p.kv))):
            k0, v0 = next(p.kv[layer] for p in prompts if p.kv)
            k = k0.new_zeros((len(prompts), k0.shape[1], width, k0.shape[3]))
            v = v0.new_zeros((len(prompts), v0.shape[1], width, v0.shape[3]))
            for i, (p, c) in enumerate(zip(prompts, past, strict=True)):
                if c:
                    k[i, :, width - c:] = p.kv[layer][0][0, :, :c]
                    v[i, :, width - c:] = p.kv[layer][1][0, :, :c]
            layers.append((k, v))
        return layers

    def clear_prefix_cache(self) -> None:
        """Forget cached KV, and keep requests running now from adding theirs (computed partly before)."""
        self.kv_epoch += 1
        if self.prefix is not None:
            self.prefix.clear()

    def _remember(self, ids: list[int], cache: KVCache, row: int, length: int) -> None:
        """Put row `row`'s last `length` KV columns (the KV of `ids`) into the prefix cache, as owned copies."""
        if self.prefix is None or not self._cacheable(cache) or length > self.prefix.max_tokens:
            return
        kv = [(k[row:row + 1, :, -length:].clone(), v[row:row + 1, :, -length:].clone()) for k, v in self._layers(cache)]
        if self._prefix_bytes and length:
            per_token = sum(k.nbytes + v.nbytes for k, v in kv) / length
            self.prefix.max_tokens = max(int(self._prefix_bytes // per_token), 1)
            self._prefix_bytes = 0
            log.info("prefix cache: %d tokens (%.0f KiB of KV each, in %.0f MiB)", self.prefix.max_tokens,
                     per_token / 1024, self.prefix.max_tokens * per_token / 2**20)
        self.prefix.insert(list(ids), kv)

    @staticmethod
    def _cacheable(cache: KVCache) -> bool:
        """Full-attention layers only: a sliding-window or recurrent layer's state is not a per-token KV."""
        return all(type(layer).__name__ == "DynamicLayer" for layer in getattr(cache, "layers", [None]))

    def _merge(self, new: list[Request], cache: KVCache, mask: torch.Tensor, pos: torch.Tensor,
               draft: KVCache = None, hid: torch.Tensor | None = None) -> None:
        self._sampling = None
        if hid is not None:
            self._hid = torch.cat([self._hid, hid.to(self._hid.dtype)]) if self.rows else hid.to(self._hid.dtype)
        if not self.rows:
            self.rows, self._cache, self._mask, self._pos, self._dcache = list(new), cache, mask, pos, draft
            self._last = torch.zeros(len(new), dtype=torch.long, device=self.device)
            return
        old_len, new_len = self._mask.shape[1], mask.shape[1]
        total = max(old_len, new_len)

        def left_pad(t: torch.Tensor, dim: int, to: int) -> torch.Tensor:
            if t.shape[dim] == to:
                return t
            shape = list(t.shape)
            shape[dim] = to - t.shape[dim]
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        def joined(old: list[tuple[torch.Tensor, ...]], new_: list[tuple[torch.Tensor, ...]], columns: bool = False
                   ) -> list[tuple[torch.Tensor, ...]]:
            return [tuple(torch.cat([left_pad(a, 2, total), left_pad(b, 2, total)]) if columns or self._columns(i)
                          else torch.cat([a, b]) for a, b in zip(x, y, strict=True))
                    for i, (x, y) in enumerate(zip(old, new_, strict=True))]

        self._cache = self._make_cache(joined(self._layers(self._cache), self._layers(cache)))
        if self._drafts_kv:
            self._dcache = DynamicCache(ddp_cache_data=joined(_plain_layers(self._dcache), _plain_layers(draft), True))
        self._mask = torch.cat([left_pad(self._mask, 1, total), left_pad(mask, 1, total)])
        self._pos = torch.cat([self._pos, pos])
        self._last = torch.cat([self._last, torch.zeros(len(new), dtype=torch.long, device=self.device)])
        self.rows += new

    def _decode(self) -> None:
        if self.speculative:
            # at most the tokens the row may still take, less the one after the drafts
            room = [min(self.speculative, r.params.max_new_tokens - len(r.output_ids) - 1,
                        self.max_context - len(r.input_ids) - len(r.output_ids) - 1) for r in self.rows]
            if self._drafts_kv:  # the draft runs every step, to keep its KV in step with the target's
                self._speculate(*self._draft_tokens(room))
                return
            drafts = [ngram_draft(r.input_ids + r.output_ids, n) for r, n in zip(self.rows, room, strict=True)]
            # every row runs as many positions as the longest draft: speculate when drafts fill at least half of them
            # (measured on small-qwen3: speculating whenever any row drafts ran 0.73x plain at temperature 0.6)
            k = max(map(len, drafts))
            if k and 2 * sum(map(len, drafts)) >= len(drafts) * k:
                padded = torch.tensor([d + [self._pad] * (k - len(d)) for d in drafts], dtype=torch.long,
                                      device=self.device)
                self._speculate(padded, torch.tensor([len(d) for d in drafts], device=self.device))
                return
            for r in self.rows:  # a verify step with nothing to verify, as SGLang counts them
                r.spec_verify_ct += 1
            self.spec_verify_ct += len(self.rows)
        b = len(self.rows)
        self._mask = torch.cat([self._mask, self._mask.new_ones((b, 1))], dim=1)
        # Without padding the model can take its causal fast path; building a mask costs ~30% at batch 1.
        mask = self._mask if bool((self._mask[:, 0] == 0).any()) else None
        experts = self._routing(self.rows)
        out = self._forward([r.lora for r in self.rows], input_ids=self._last[:, None], attention_mask=mask,
                            position_ids=self._pos[:, None], past_key_values=self._cache, use_cache=True)
        if experts is not None:
            taken = experts.take(b, 1)
            for i, r in enumerate(self.rows):
                if r.return_routed_experts:
                    r.routed.append(taken[i])
        self._cache = out.past_key_values
        self._pos = self._pos + 1
        self.steps += 1
        self._emit(out.logits[:, -1].float())

    def _draft_tokens(self, room: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draft model's `speculative` tokens per row, each drawn as the row samples (`propose`), and the
        distributions they were drawn from. It runs the row's last token and each draft, the last one only for its
        KV, so that it holds the columns the target's verify forward adds. A row's drafts past its `room` are
        padding (`verify` takes none)."""
        b, k, vocab = len(self.rows), self.speculative, self.model.config.get_text_config().vocab_size
        params = [r.params for r in self.rows]
        mask, token = self._mask, self._last
        drafts, dists = [], []
        if self.mtp is not None:
            return self._mtp_tokens(room)
        assert self.draft is not None
        for j in range(k + 1):
            mask = torch.cat([mask, mask.new_ones((b, 1))], dim=1)
            out = self.draft(input_ids=token[:, None], attention_mask=mask if bool((mask[:, 0] == 0).any()) else None,
                             position_ids=self._positions(self._pos[:, None] + j), past_key_values=self._dcache,
                             use_cache=True)
            self._dcache = out.past_key_values
            if j == k:
                break
            logits = out.logits[:, -1, :vocab].float()  # (a draft's embedding may have other padding rows)
            seeds = {i: (r.params.sampling_seed, len(r.output_ids) + j) for i, r in enumerate(self.rows)
                     if r.params.sampling_seed is not None}
            token, q = propose(logits, params, self.generator, seeds)
            drafts.append(token)
            dists.append(torch.nn.functional.pad(q, (0, vocab - q.shape[-1])))
        lengths = torch.tensor(room, device=self.device).clamp(min=0)
        return torch.stack(drafts, 1), lengths, torch.stack(dists, 1)

    def _mtp_tokens(self, room: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_draft_tokens` from the MTP layer: the first draft from ``[last; h]`` (the target's hidden state at the
        row's last column), each next one from the previous draft and the layer's own output (EAGLE's chain). Only
        the first entry is kept in its KV: the verify forward's hidden states make the others (`_speculate`)."""
        assert self.mtp is not None
        b, k, vocab = len(self.rows), self.speculative, self.model.config.get_text_config().vocab_size
        params = [r.params for r in self.rows]
        mask, token, hid = self._mask, self._last, self._hid
        drafts, dists = [], []
        for j in range(k):
            mask = torch.cat([mask, mask.new_ones((b, 1))], dim=1)
            out, logits, self._dcache = self.mtp(token[:, None], hid[:, None], mtp_mask(mask),
                                                 self._positions(self._pos[:, None] - 1 + j), self._dcache)
            seeds = {i: (r.params.sampling_seed, len(r.output_ids) + j) for i, r in enumerate(self.rows)
                     if r.params.sampling_seed is not None}
            if j == 0 and self.mtp.trace is not None:
                self.mtp.trace += [(r.rid, int(p) - 1, x) for r, p, x in zip(self.rows, self._pos, logits[:, -1],
                                                                             strict=True)]
            token, q = propose(logits[:, -1, :vocab].float(), params, self.generator, seeds)
            hid = out[:, -1]
            drafts.append(token)
            dists.append(torch.nn.functional.pad(q, (0, vocab - q.shape[-1])))
        if k > 1:
            keep = self._mask.shape[1] + 1
            self._dcache = DynamicCache(ddp_cache_data=[(a[:, :, :keep], v[:, :, :keep])
                                                        for a, v in _plain_layers(self._dcache)])
        lengths = torch.tensor(room, device=self.device).clamp(min=0)
        return torch.stack(drafts, 1), lengths, torch.stack(dists, 1)

    def _speculate(self, padded: torch.Tensor, lengths: torch.Tensor, q: torch.Tensor | None = None) -> None:
        """One decode step that also verifies each row's drafts `padded` ``[B, k]`` (the first `lengths[b]` are
        row b's; `q`: the distributions they were drawn from, None for n-gram drafts): feeds ``[last, d_1 .. d_k]``,
        takes what `verify` accepts plus the token after, and drops the KV of the rest."""
        b, k = padded.shape
        self._mask = torch.cat([self._mask, self._mask.new_ones((b, k + 1))], dim=1)
        mask = self._mask if bool((self._mask[:, 0] == 0).any()) else None
        experts = self._routing(self.rows)
        out = self._forward([r.lora for r in self.rows], input_ids=torch.cat([self._last[:, None], padded], 1),
                            attention_mask=mask,
                            position_ids=self._positions(self._pos[:, None] + torch.arange(k + 1, device=self.device)),
                            past_key_values=self._cache, use_cache=True)
        taken = experts.take(b, k + 1) if experts is not None else None
        self._cache = out.past_key_values
        self.steps += 1
        if self.mtp is not None:  # the MTP entries of the drafts' columns, from the target's hidden states
            hidden = self.mtp.hidden
            assert hidden is not None
            _, _, self._dcache = self.mtp(padded, hidden[:, :k], mtp_mask(self._mask),
                                          self._positions(self._pos[:, None] + torch.arange(k, device=self.device)),
                                          self._dcache)
            self.model.rlx_final_hidden = None  # (read: not kept alive)
        seeds = {i: (r.params.sampling_seed, len(r.output_ids)) for i, r in enumerate(self.rows)
                 if r.params.sampling_seed is not None}
        tokens, logprobs, accepted = verify(out.logits.float(), padded, lengths, [r.params for r in self.rows],
                                            self.generator, seeds, q)
        kept, done = [], []
        for i, (r, toks, lps, n_ok) in enumerate(zip(self.rows, tokens.tolist(), logprobs.tolist(),
                                                     accepted.tolist(), strict=True)):
            n = 0
            for tok, lp in zip(toks[:n_ok + 1], lps[:n_ok + 1], strict=True):
                if r.per_token_extras:
                    extras(r, out.logits[i, n])
                n += 1
                reason = self._append(r, tok, lp)
                if reason is not None:
                    self._finish(r, reason)
                    done.append(i)
                    break
            else:
                if r.on_token is not None:
                    r.text = self._text(r)
                    r.on_token(r)
            kept.append(n)
            r.spec_verify_ct += 1
            r.spec_proposed += int(lengths[i])
            r.spec_correct += min(n_ok, n)
            self.spec_correct += min(n_ok, n)
            if taken is not None and r.return_routed_experts:
                r.routed.append(taken[i, :n])
        self.spec_verify_ct += b
        self.spec_proposed += int(lengths.sum())
        n_kept = torch.tensor(kept, device=self.device)
        if self.mtp is not None:
            assert hidden is not None
            self._hid = hidden[torch.arange(b, device=self.device), n_kept - 1].to(self._hid.dtype)
        self._pos = self._pos + n_kept
        self._last = tokens[torch.arange(b, device=self.device), n_kept - 1]
        self._keep_columns(k + 1 - n_kept)
        self._retire(done)

    def _positions(self, pos: torch.Tensor) -> torch.Tensor:
        """Position ids of a speculative forward: a row's drafts never pass its context (its `room`), but its padding
        columns may; they are refused whatever they compute, so they take the last position there is (a learned
        position table has no row past it, and a scaled rotary embedding would rescale the whole batch)."""
        return pos.clamp(max=self.max_context - 1)

    def _keep_columns(self, refused: torch.Tensor) -> None:
        """Drop each row's last `refused[b]` KV columns, shifting the row right by as many (its front becomes
        padding): rows stay right-aligned, as decoding them on needs."""
        if not bool(refused.any()):
            return
        width = self._mask.shape[1]
        src = torch.arange(width, device=self.device)[None, :] - refused[:, None]  # [B, W] column each comes from
        valid = src >= 0
        src = src.clamp(min=0)

        def shifted(t: torch.Tensor) -> torch.Tensor:  # [B, heads, W, d]
            return t.gather(2, src[:, None, :, None].expand(t.shape[0], t.shape[1], width, t.shape[3]))

        self._set_columns(self._mask.gather(1, src) * valid,
                          *([tuple(shifted(t) for t in state) for state in layers] for layers in self._state()))

    def _forward(self, adapters: list[str | None], **inputs: Any) -> Any:
        """The model's forward over rows generated with these LoRA adapters (None: the base model)."""
        if self.adapters is None:
            return self.model(**inputs)
        with self.adapters.serving(adapters):
            return self.model(**inputs)

    def _routing(self, rows: list[Request]) -> RoutedExperts | None:
        """The recorder, when this forward records routed experts (some row asked, and the engine captures them)."""
        if self.experts is None or not any(r.return_routed_experts for r in rows):
            return None
        self.experts.begin()
        return self.experts

    # -- sampling and stopping -----------------------------------------------------------------

    def _emit(self, logits: torch.Tensor, row_idx: list[int] | None = None) -> None:
        """Sample for `row_idx` (all rows when None), append, and retire rows that stopped."""
        rows = self.rows if row_idx is None else [self.rows[i] for i in row_idx]
        seeded = {i: seeded_uniform(r.params.sampling_seed, len(r.output_ids))
                  for i, r in enumerate(rows) if r.params.sampling_seed is not None}
        if row_idx is None:
            row_idx = list(range(len(self.rows)))
            if self._sampling is None:
                self._sampling = SamplingTensors([r.params for r in rows], self.device)
            tokens, logprobs = sample(logits, self._sampling, self.generator, seeded)
            self._last = tokens
        else:
            tokens, logprobs = sample(logits, [r.params for r in rows], self.generator, seeded)
            self._last.index_copy_(0, torch.tensor(row_idx, device=self.device), tokens)
        done: list[int] = []
        for j, (i, r, tok, lp) in enumerate(zip(row_idx, rows, tokens.tolist(), logprobs.tolist(), strict=True)):
            if r.per_token_extras:
                extras(r, logits[j])
            reason = self._append(r, tok, lp)
            if reason is not None:
                self._finish(r, reason)
                done.append(i)
            elif r.on_token is not None:
                r.text = self._text(r)
                r.on_token(r)
        self._retire(done)

    def _append(self, r: Request, tok: int, lp: float) -> dict[str, Any] | None:
        """Append a sampled token to its request; returns why the request stops there, if it does."""
        r.output_ids.append(tok)
        r.logprobs.append(lp)
        r.versions.append(self.weight_version)
        r.first_token_at = r.first_token_at or time.monotonic()
        self.generated_tokens += 1
        return self._stop_reason(r, tok)

    def _retire(self, done: list[int]) -> None:
        """Drop the rows that finished, keeping their KV in the prefix cache."""
        if not done:
            return
        for i in done:  # the KV of everything fed so far: the prompt and all but the last output token
            r = self.rows[i]
            if not r.aborted and r.kv_epoch == self.kv_epoch and r.lora is None:  # (the cache holds the base's KV)
                seq = (r.input_ids + r.output_ids)[:-1]
                self._remember(seq, self._cache, i, len(seq))
        self._select([i for i in range(len(self.rows)) if i not in set(done)])

    def _stop_reason(self, r: Request, tok: int) -> dict[str, Any] | None:
        p = r.params
        if tok in p.stop_token_ids or (tok in self.eos_ids and not p.ignore_eos):
            return {"type": "stop", "matched": tok}
        if p.stop:
            tail = self.tokenizer.decode(r.output_ids[-(max(map(len, p.stop)) + 8):])
            for s in p.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if len(r.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(r.input_ids) + len(r.output_ids) >= self.max_context:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    def _text(self, r: Request) -> str:
        ids = r.output_ids
        if r.finish_reason and r.finish_reason.get("type") == "stop" and isinstance(
            r.finish_reason.get("matched"), int
        ):
            ids = ids[:-1]  # the stop token is not part of the text
        text = self.tokenizer.decode(ids, skip_special_tokens=r.params.skip_special_tokens)
        matched = (r.finish_reason or {}).get("matched")
        if isinstance(matched, str) and not r.params.no_stop_trim:
            cut = text.find(matched)
            text = text[:cut] if cut >= 0 else text
        return text

    def _finish(self, r: Request, reason: dict[str, Any]) -> None:
        if r.lora_held and self.adapters is not None and r.lora is not None:
            r.lora_held = False
            self.adapters.release(r.lora)
        r.finish_reason = reason
        r.text = self._text(r)
        if r.on_done is not None:
            r.on_done(r)

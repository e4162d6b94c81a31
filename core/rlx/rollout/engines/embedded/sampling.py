"""Sampling for the embedded engine: vectorised over rows, each row with its own temperature, top-p, top-k and
min-p. The logprob reported for a token is ``log_softmax(logits / temperature)`` at that token, before top-k or
top-p truncation (SGLang's default), and the plain ``log_softmax(logits)`` when greedy.

A request with a ``sampling_seed`` (SGLang's parameter) draws each token from a number that depends only on that seed
and the token's position (`seeded_uniform`), not on the engine's generator, so it samples the same tokens from the same
logits whatever else the engine runs and in whatever order (``run.deterministic``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None  # the request's own randomness (`seeded_uniform`)


class SamplingTensors:
    """Per-row sampling parameters as tensors, built once per batch composition, not per step."""

    def __init__(self, params: list[SamplingParams], device: torch.device):
        self.temps = torch.tensor([p.temperature for p in params], device=device)
        self.greedy = self.temps <= 0
        self.all_greedy = bool(self.greedy.all())
        self.divisor = torch.where(self.greedy, torch.ones_like(self.temps), self.temps)[:, None]
        self.top_k = torch.tensor([p.top_k for p in params], device=device)
        self.top_p = torch.tensor([p.top_p for p in params], device=device)
        self.min_p = torch.tensor([p.min_p for p in params], device=device)
        self.truncate = bool((self.top_k > 0).any() | (self.top_p < 1).any())
        self.use_min_p = bool((self.min_p > 0).any())


def sample(logits: torch.Tensor, params: list[SamplingParams] | SamplingTensors, generator: torch.Generator,
           seeded: dict[int, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row, with that row's sampling parameters; returns (tokens, logprobs). `seeded`: the uniform
    number of each row (by index) that has its own (`seeded_uniform`); the others draw from `generator`."""
    t = params if isinstance(params, SamplingTensors) else SamplingTensors(params, logits.device)
    logp = torch.log_softmax(logits / t.divisor, dim=-1)
    if t.all_greedy:
        tokens = logits.argmax(-1)
        return tokens, logp.gather(1, tokens[:, None])[:, 0]
    tokens = torch.where(t.greedy, logits.argmax(-1), draw(kept(logp, t), generator, seeded))
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def kept(logp: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The probabilities a row samples from, unnormalised: ``exp(logp)`` less what top-k, top-p and min-p drop."""
    probs = logp.exp()
    if t.truncate:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=logp.device)[None, :]
        drop = (t.top_k[:, None] > 0) & (rank >= t.top_k[:, None])
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it stays).
        drop |= (sorted_p.cumsum(-1) - sorted_p) >= t.top_p[:, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    if t.use_min_p:
        probs = probs.masked_fill(probs < t.min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
    return probs


# the salt that makes a seeded row's acceptance numbers (`verify`) other numbers than its draws
_ACCEPT_SALT = 0x5EC0DE


# the salt of a seeded row's draft draws (`propose`)
_DRAFT_SALT = 0xD4AF7


def propose(logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator,
            seeds: dict[int, tuple[int, int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft model's token per row, drawn as `sample` would draw from its logits, and the distribution it was
    drawn from, normalised ``[B, V]`` (one-hot at the argmax for a greedy row): `verify`'s ``q``. `seeds`: row ->
    (sampling_seed, position), whose draws come from `seeded_uniform` (salted)."""
    t = SamplingTensors(params, logits.device)
    logp = torch.log_softmax(logits / t.divisor, dim=-1)
    greedy = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logp.dtype)
    q = greedy if t.all_greedy else kept(logp, t)
    q = torch.where(t.greedy[:, None], greedy, q / q.sum(-1, keepdim=True))
    seeded = {i: seeded_uniform(seed ^ _DRAFT_SALT, at) for i, (seed, at) in (seeds or {}).items()}
    return draw(q, generator, seeded), q


def verify(logits: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor, params: list[SamplingParams],
           generator: torch.Generator, seeds: dict[int, tuple[int, int]] | None = None,
           q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): the tokens follow exactly the distribution
    `sample` draws from, token after token, whatever the drafts.

    `logits` ``[B, k + 1, V]``: the target's at the row's last token and at each of its `k` drafts; `drafts`
    ``[B, k]``, of which the first `lengths[b]` are row b's (the rest is padding, never accepted); `q` ``[B, k, V]``:
    the distributions the drafts were drawn from (`propose`), or None for drafts that are point masses (n-gram
    lookup). A draft passes with probability ``min(1, p(d) / q(d))`` (``p(d)`` for a point mass); the first refused
    one is replaced by a draw from ``max(p - q, 0)`` normalised (for a point mass, ``p`` without ``d``); a row whose
    drafts all pass draws its next token from ``p`` after the last one. Greedy rows accept the drafts that are the
    argmax and then take the argmax. ``p`` is the row's distribution after temperature, top-k, top-p and min-p, as
    `sample` draws from it.

    `seeds`: row -> (sampling_seed, index of the row's next output token): such a row's numbers come from
    `seeded_uniform` (its acceptance numbers salted), not from `generator`.

    Returns (tokens ``[B, k + 1]``, their logprobs as `sample` reports them, accepted ``[B]``): row b's new tokens
    are ``tokens[b, :accepted[b] + 1]``."""
    b, k1, v = logits.shape
    k = k1 - 1
    dev = logits.device
    t = SamplingTensors([p for p in params for _ in range(k1)], dev)
    logp = torch.log_softmax(logits.reshape(-1, v) / t.divisor, dim=-1)
    greedy = t.greedy.view(b, k1)[:, 0]
    target = logits.argmax(-1)  # [B, k + 1]
    rows = torch.arange(b, device=dev)
    real = torch.arange(k, device=dev)[None, :] < lengths[:, None]  # [B, k]
    if t.all_greedy:
        probs = None
        ok = drafts == target[:, :k]
    else:
        probs = kept(logp, t).view(b, k1, v)
        probs = probs / probs.sum(-1, keepdim=True)
        u = torch.rand((b, k), generator=generator, device=dev, dtype=torch.float64)
        for i, (seed, at) in (seeds or {}).items():
            u[i] = torch.tensor([seeded_uniform(seed ^ _ACCEPT_SALT, at + j) for j in range(k)], dtype=u.dtype)
        p_d = probs[:, :k].gather(2, drafts[..., None])[..., 0].double()
        q_d = 1.0 if q is None else q.gather(2, drafts[..., None])[..., 0].double()
        ok = torch.where(greedy[:, None], drafts == target[:, :k], u * q_d < p_d)
    accepted = (ok & real).int().cumprod(1).sum(1)  # [B]
    last = target[rows, accepted]
    if probs is not None:
        p = probs[rows, accepted]  # [B, V]
        rejected = accepted < lengths  # a draft was refused here: draw from p without it
        refused_at = accepted.clamp(max=max(k - 1, 0))
        if q is None:
            d = drafts[rows, refused_at] if k else torch.zeros(b, dtype=torch.long, device=dev)
            residual = p.scatter(1, d[:, None], 0.0)
        else:
            residual = (p - q[rows, refused_at]).clamp(min=0)
        residual = torch.where(rejected[:, None] & (residual.sum(-1, keepdim=True) > 0), residual, p)
        seeded = {i: seeded_uniform(seed, at + int(accepted[i])) for i, (seed, at) in (seeds or {}).items()}
        last = torch.where(greedy, last, draw(residual, generator, seeded))
    tokens = torch.cat([drafts, drafts.new_zeros(b, 1)], 1)
    tokens[rows, accepted] = last
    return tokens, logp.view(b, k1, v).gather(2, tokens[..., None])[..., 0], accepted


def draw(probs: torch.Tensor, generator: torch.Generator, seeded: dict[int, float] | None = None) -> torch.Tensor:
    """One token per row with the rows' (unnormalised) probabilities, by inverting the cumulative sum at one
    uniform number per row: the same distribution as ``torch.multinomial``, which draws a number per vocabulary
    entry (13 ms against 0.3 ms for 16 rows of a 49k vocabulary on CPU). `seeded`: rows' own numbers, by index."""
    cdf = probs.cumsum(-1, dtype=torch.float64)  # float32 sums over 150k entries would blur the smallest odds
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cdf.dtype)
    if seeded:
        rows = torch.tensor(list(seeded), device=probs.device)
        u[rows, 0] = torch.tensor(list(seeded.values()), device=probs.device, dtype=cdf.dtype)
    u = u * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True)[:, 0]  # first entry whose cdf exceeds u: its probability is > 0
    over = tokens >= probs.shape[-1]  # u rounded up to the total: the last token with a probability
    if bool(over.any()):
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
        tokens = torch.where(over, last, tokens)
    return tokens


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser (Steele et al. 2014): a bijection of 64-bit integers whose outputs look independent."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that depends only on (`seed`, `position`): the draw of a request's token at `position` (its
    index among the request's output tokens)."""
    return (_mix64((_mix64(seed & _MASK64) + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64) >> 11) / (1 << 53)

"""Data that crosses module boundaries: samples, groups, rewards and batches.

Plain dataclasses with no torch in them, so that rollout workers, the buffer service, plugins and tests
can build and inspect them cheaply. Token ids are the ids the engine sampled (token-in-token-out): text
is kept alongside for people and rewards, never re-encoded into training data.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

#: A JSON value as parsed (an object, array, string, number, bool or None): checked where it is read.
JSON = Any
#: A transformers tokenizer (``PreTrainedTokenizerBase``): its methods' types vary by model, so it is typed loosely.
Tokenizer = Any
#: A transformers model (``PreTrainedModel``) and its KV cache (``Cache``), loosely: their config, layers and cache
#: layers vary by model family (a union the library's types do not narrow).
HFModel = Any
KVCache = Any
#: A transformers model config (``PretrainedConfig``): its attributes depend on the model family.
HFConfig = Any


class SampleStatus(str, enum.Enum):
    """Where a sample is in its life. Only COMPLETED and TRUNCATED samples are trained on."""

    PENDING = "pending"  # created, not generated yet (or waiting to resume a partial rollout)
    COMPLETED = "completed"  # the engine stopped on EOS or a stop sequence
    TRUNCATED = "truncated"  # the engine stopped at max_new_tokens or the context limit
    ABORTED = "aborted"  # generation was cut at a step boundary; may resume from its prefix
    FAILED = "failed"  # generation or a reward raised; `error` says why
    FILTERED = "filtered"  # dropped by a group filter (e.g. zero reward variance)

    @property
    def trainable(self) -> bool:
        return self in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)


@dataclass
class RewardResult:
    """What a reward returns: a score, and optionally the parts it was made of.

    `parts` are logged as metrics (`reward/<name>/<part>`); only `score` enters the advantage.
    """

    score: float
    parts: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # anything worth keeping, e.g. the parsed answer


@dataclass
class TeacherScore:
    """What a teacher said of a sample's response tokens (on-policy distillation), each list one entry per response
    token, tool and user tokens too (the teacher reads the whole sample; the KL counts the loss mask's tokens)."""

    name: str  # the teacher (rollout.teachers[*].name)
    logprobs: list[float]  # the teacher's log-prob of each response token
    top_ids: list[list[int]] = field(default_factory=list)  # estimator top_k: its top tokens at each position
    top_logprobs: list[list[float]] = field(default_factory=list)  # and their log-probs

    def reverse_kl(self, sample: Sample) -> tuple[float, int]:
        """The sampled-token estimate of the reverse KL summed over the model's tokens (the sampler's log-prob
        minus the teacher's), and their count; (0, 0) without the sampler's log-probs."""
        if sample.rollout_logprobs is None:
            return 0.0, 0
        pairs = [(r - t) for r, t, m in zip(sample.rollout_logprobs, self.logprobs, sample.loss_mask, strict=True) if m]
        return sum(pairs), len(pairs)


@dataclass
class Sample:
    """One generated response to one prompt, and everything training needs from it."""

    prompt_ids: list[int]  # the prompt exactly as sent to the engine (chat template already applied)
    response_ids: list[int] = field(default_factory=list)  # every token after the prompt, in order
    loss_mask: list[int] = field(default_factory=list)  # per response token: 1 model-sampled, 0 tool/user
    # engine logprob per response token (0 where the mask is 0); None: the engine (or the buffer client) gave
    # none, so no importance correction applies to this sample
    rollout_logprobs: list[float] | None = field(default_factory=list)
    # per response token: the sampling temperature of the distribution it came from (empty: all 1.0)
    token_temperatures: list[float] = field(default_factory=list)
    prompt_text: str = ""  # for people and rewards only
    response_text: str = ""  # for people and rewards only
    label: Any = None  # the reference answer from the dataset, given to rewards
    reward: float | None = None  # the combined reward used for advantages
    rewards: dict[str, RewardResult] = field(default_factory=dict)  # each reward's own result, by name
    status: SampleStatus = SampleStatus.PENDING  # where it is in its life; FAILED: a reward or the generator failed
    finish_reason: str | None = None  # the engine's: "stop", "length", "abort"
    error: str | None = None  # why the sample FAILED
    group_id: int = -1  # which prompt group this sample belongs to
    sample_id: int = -1  # unique within a run; the order training sees samples in is checked by it
    index: int = 0  # position within its group
    trajectory_id: int | None = None  # samples branched from one trajectory share it (None: its own)
    weight_version: int = 0  # policy version that generated it (lowest, for a resumed partial rollout)
    token_versions: list[int] = field(default_factory=list)  # per response token: the weights that sampled it
    metadata: dict[str, Any] = field(default_factory=dict)  # dataset metadata and generator notes
    # the experts the engine routed each token to (rollout routing replay): SGLang's base64 int32
    # [rows, layers, top_k] for the first `rows` tokens of prompt + response (rows <= total_len - 1)
    routed_experts: str | None = None
    teacher: TeacherScore | None = None  # on-policy distillation: its teacher's scores (None: not distilled)
    adapter: str | None = None  # the LoRA adapter its last model tokens came from, as engines name it ("actor-v3")
    lora: str | None = None  # multi-LoRA: the adapter (train.lora.adapters) that samples it and trains on it

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        d = dict(d)
        d["status"] = SampleStatus(d.get("status", "pending"))
        d["rewards"] = {k: RewardResult(**v) for k, v in (d.get("rewards") or {}).items()}
        if d.get("teacher") is not None:
            d["teacher"] = TeacherScore(**d["teacher"])
        if (d.get("metadata") or {}).pop("no_rollout_logprobs", False):  # saved before None meant "missing"
            d["rollout_logprobs"] = None
        return cls(**d)


@dataclass
class Group:
    """The samples drawn for one prompt; GRPO-style advantages are computed within a group."""

    group_id: int
    samples: list[Sample]
    prompt_index: int = -1  # position of the prompt in the dataset (for exact resume)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples if s.reward is not None]

    @property
    def trainable(self) -> list[Sample]:
        return [s for s in self.samples if s.status.trainable]

    @property
    def oldest_version(self) -> int | None:
        """The oldest weight version behind any model-sampled token of the group (None: none yet)."""
        versions: list[int] = []
        for s in self.samples:
            if s.token_versions:
                versions += [v for v, m in zip(s.token_versions, s.loss_mask, strict=False) if m]
            elif s.response_ids:
                versions.append(s.weight_version)
        return min(versions) if versions else None

    def to_dict(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "prompt_index": self.prompt_index, "metadata": self.metadata,
                "samples": [s.to_dict() for s in self.samples]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Group:
        return cls(d["group_id"], [Sample.from_dict(s) for s in d["samples"]], d["prompt_index"], d["metadata"])


@dataclass
class RolloutBatch:
    """What one rollout step hands to training: whole groups, any number of samples each.

    The global batch size varies: a prompt may yield many samples (n per prompt, or an agent's
    branches), and training uses all of them, normalising over groups rather than padding or dropping.
    """

    step: int
    groups: list[Group]
    weight_version: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]

    @property
    def num_tokens(self) -> int:
        return sum(s.total_len for s in self.samples)

    def sample_metrics(self) -> dict[str, float]:
        """What the samples say of themselves: counts by status, the mean reward (and each reward's) and response
        length over the trainable ones."""
        samples = self.samples
        trainable = [s for s in samples if s.status.trainable]
        rewards = [s.reward for s in trainable if s.reward is not None]
        lens = [len(s.response_ids) for s in trainable]
        m = {
            "rollout/groups": float(len(self.groups)),
            "rollout/samples": float(len(samples)),
            "rollout/failed": float(sum(s.status == SampleStatus.FAILED for s in samples)),
            "rollout/truncated": float(sum(s.status == SampleStatus.TRUNCATED for s in samples)),
            "reward/mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "response_len/mean": sum(lens) / len(lens) if lens else 0.0,
        }
        for name in sorted({s.lora for s in samples if s.lora is not None}):  # multi-LoRA: each adapter's own
            mine = [s for s in trainable if s.lora == name]
            got = [s.reward for s in mine if s.reward is not None]
            m[f"lora/{name}/reward_mean"] = sum(got) / len(got) if got else 0.0
            m[f"lora/{name}/samples"] = float(len(mine))
        spec = [s.metadata["speculative"] for s in samples if "speculative" in s.metadata]
        if spec:  # as SGLang reports them: drafts accepted of those proposed, tokens per verify step
            verify, proposed, correct, tokens = (sum(c[i] for c in spec) for i in range(4))
            m["rollout/spec_accept_rate"] = correct / proposed if proposed else 0.0
            m["rollout/spec_accept_length"] = tokens / verify if verify else 0.0
        kl: dict[str, list[float]] = {}  # per teacher: the sum over model tokens of sampler minus teacher, the count
        for s in trainable:
            if s.teacher is not None:
                part = kl.setdefault(s.teacher.name, [0.0, 0.0])
                for i, v in enumerate(s.teacher.reverse_kl(s)):
                    part[i] += v
        for name, (kl_sum, count) in sorted(kl.items()):  # (none without the sampler's log-probs)
            if count:
                m[f"distill/{name}/reverse_kl"] = kl_sum / count
        kl_sum, count = (sum(v[i] for v in kl.values()) for i in (0, 1))
        if count:
            m["distill/reverse_kl"] = kl_sum / count
        for name in sorted({name for s in trainable for name in s.rewards}):
            vals = [s.rewards[name].score for s in trainable if name in s.rewards]
            m[f"reward/{name}/mean"] = sum(vals) / len(vals)
        return m


@dataclass
class GenerateResult:
    """One generation as the engine answered it (SGLang's ``/generate`` result, parsed by `from_json`)."""

    text: str
    output_ids: list[int]
    output_logprobs: list[float]  # one per output id; empty unless return_logprob
    finish_reason: str  # "stop", "length" or "abort"
    matched_stop: int | str | None  # the stop token id or string that ended generation
    weight_version: str
    token_weight_versions: list[str]  # per output id, when the engine reports it (SGLang >= 0.5.23)
    prompt_tokens: int
    rid: str | None
    raw: dict[str, Any]
    temperature: float | None = None  # the request's sampling temperature (set by the caller)
    # SGLang's meta_info.routed_experts: base64 of int32 [prompt + output tokens - 1, layers, top_k], when asked
    routed_experts: str | None = None
    cached_tokens: int = 0  # prompt tokens the engine took from its prefix cache (SGLang's meta_info)
    # speculative decoding's counts, where the engine reports them (SGLang's meta_info): (verify steps, drafts
    # proposed, drafts accepted, tokens)
    spec: tuple[int, int, int, int] | None = None
    lora_path: str | None = None  # the LoRA adapter it was generated with (set by the caller; None: the base model)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GenerateResult:
        meta = d.get("meta_info", {})
        fr = meta.get("finish_reason") or {}
        if isinstance(fr, str):
            fr = {"type": fr}
        lps = meta.get("output_token_logprobs") or []
        output_ids = d.get("output_ids")
        if output_ids is None:  # very old servers: ids only inside the logprob triples
            output_ids = [t[1] for t in lps]
        return cls(
            text=d.get("text", ""),
            output_ids=list(output_ids),
            output_logprobs=[float(t[0]) for t in lps],
            finish_reason=fr.get("type", "unknown"),
            matched_stop=fr.get("matched"),
            weight_version=str(meta.get("weight_version", "")),
            token_weight_versions=token_versions(meta.get("weight_versions"), len(output_ids)),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            rid=meta.get("id"),
            raw=d,
            routed_experts=meta.get("routed_experts"),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            spec=(int(meta["spec_verify_ct"]), int(meta["spec_num_proposed_drafts"]),
                  int(meta.get("spec_num_correct_drafts") or 0), len(output_ids))
            if meta.get("spec_verify_ct") and "spec_num_proposed_drafts" in meta else None,
        )


def token_versions(spans: JSON, n: int) -> list[str]:
    """Per-token weight versions from SGLang's ``meta_info.weight_versions`` spans (0.5.23+: a list of
    ``{"version", "start", "end"}`` over output-token positions, on finished results only); an empty list
    when the engine sends none (0.5.5 reports one ``weight_version`` per result) or the spans do not cover
    exactly the `n` output tokens."""
    if not spans:
        return []
    out: list[str] = []
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if start != len(out) or end < start:
            return []
        out += [str(span["version"])] * (end - start)
    return out if len(out) == n else []

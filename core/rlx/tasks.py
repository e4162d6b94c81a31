"""Procedurally generated, verifiable tasks: no download, any size, a known answer per prompt."""

from __future__ import annotations

import json
import random
from pathlib import Path


def arithmetic(n: int, seed: int = 0, max_operand: int = 20, ops: str = "+-") -> list[dict]:
    """Rows ``{"prompt": "what is 3 + 4", "label": "7"}`` with small operands."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        rows.append({"prompt": f"what is {a} {op} {b}", "label": str(eval(f"{a}{op}{b}")),
                     "metadata": {"task": "arithmetic", "id": i}})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


if __name__ == "__main__":
    import sys

    write_jsonl(arithmetic(int(sys.argv[2]) if len(sys.argv) > 2 else 512), Path(sys.argv[1]))

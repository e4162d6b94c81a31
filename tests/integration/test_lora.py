"""LoRA on the actor (`rlx.train.lora`) as a run trains it: the same two GRPO steps (two updates each, a reference
for the KL) at TP=2 and, on a tiny MoE, at EP=2 as in one process; only the adapters move (every other weight as
loaded, each adapted projection by a matrix of rank r at most); `rl train` pushes the adapters alone (engines serve
base + adapter), or the merged weights, every tensor's hash checked on the engine. Checkpoints across layouts:
tests/integration/test_reshard.py; serving adapters: tests/integration/test_lora_serving.py."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlx.testing.parallel import assert_same, run
from rlx.testing.runs import small_run_config

pytestmark = pytest.mark.integration

LORA = {"rank": 4, "alpha": 8}
KEYS = ("loss", "pg_loss", "entropy", "kl", "grad_norm", "lora/params")


def test_lora_at_tp2_trains_as_one_process_and_moves_adapters_only(tiny_model_path, tmp_path):
    from safetensors.torch import load_file

    single = run(tmp_path, tiny_model_path, 1, lora=LORA)
    assert single["m2"]["kl"] > 0 and single["m1"]["loss"] != single["m2"]["loss"]  # the adapters moved
    # per layer, rank 4: q/k/v A [4, 64] + B [64 + 32 + 32, 4]; o A [4, 64] + B [64, 4]; gate/up A [4, 64] +
    # B [2 * 192, 4]; down A [4, 192] + B [64, 4]: 768 + 512 + 1792 + 1024 = 4096; two layers
    assert single["m1"]["lora/params"] == 8192
    assert_same(run(tmp_path, tiny_model_path, 2, tp=2, lora=LORA), single, KEYS)  # peft's adapters too
    loaded = {}
    for f in Path(tiny_model_path).glob("*.safetensors"):
        loaded.update(load_file(f))
    adapted = 0
    for name, flat in single["weights"].items():
        if ".lora_" in name:  # the adapters, as peft lays them out (their export: below)
            continue
        was = loaded[name].float()
        now = torch.tensor(flat).reshape(was.shape)
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                          "up_proj.weight", "down_proj.weight")):
            delta = now - was
            assert delta.abs().max() > 0 and torch.linalg.matrix_rank(delta, atol=1e-6) <= LORA["rank"], name
            adapted += 1
        else:  # embeddings, norms: frozen
            assert torch.equal(now, was), name
    assert adapted == 2 * 7  # two layers, seven projections each


def test_the_parts_of_a_fused_projection_are_targeted_together_and_every_target_is_a_projection(tiny_model_path,
                                                                                                 tmp_path):
    with pytest.raises(AssertionError, match="q_proj, k_proj, v_proj are one fused projection in megatron "
                                             r"\(self_attention.linear_qkv\): target all of them or none"):
        run(tmp_path, tiny_model_path, 1, lora={"target_modules": ["q_proj", "o_proj"]})
    # a target the model has no projection for is an error, not a silent no-op (the default takes those it has)
    with pytest.raises(AssertionError, match="train.lora.target_modules: in_proj_qkvz, out_proj name no projection of "
                                             "this model"):
        run(tmp_path, tiny_model_path, 1, lora={"target_modules": ["o_proj", "out_proj", "in_proj_qkvz"]})


def test_lora_on_experts_at_ep2_trains_as_one_process(tmp_path):
    if importlib.util.find_spec("rlx_model_qwen") is None:
        pytest.skip("the tiny MoE is rlx-model-qwen's (pip install -e plugins/models/qwen)")
    from rlx.models.tiny import resolve_model_path

    model = resolve_model_path("builtin://tiny-qwen3-moe")
    single = run(tmp_path, model, 1, lora=LORA)
    assert_same(run(tmp_path, model, 2, ep=2, lora=LORA), single, KEYS)


@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_rl_train_pushes_only_the_adapters_and_the_engine_serves_them(tiny_model_path, tmp_path, transport):
    """`rl train` (no Ray) with ``train.lora.push: adapter``: each push moves the adapters' bytes alone, loaded by the
    engine as an adapter named for that version (``actor-vN-<hex>``), which every later request names and every sample records;
    the trainer's and the engine's log-probs agree although the policy has moved far from the base model."""
    from transformers import AutoConfig

    from rlx.data.replay import read_batches

    cfg = small_run_config(tmp_path, "run", train={"num_steps": 3, "lora": {"rank": 8, "alpha": 16},
                                                   "optim": {"lr": 1e-2}, "objective": {"kl_coef": 0.01}},
                           weight_sync={"transport": {"name": transport}}, rollout={"save_batches": True},
                           ray={"enabled": False})
    p = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    c = AutoConfig.from_pretrained(tiny_model_path)
    h, q, kv, i = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.intermediate_size
    # per layer, rank 8, in peft's layout (q, k and v each with their copy of the shared A; gate and up too)
    floats = 8 * (6 * h + i) + 8 * (q + 2 * kv + h + 2 * i + h)
    assert [r["weight_sync/bytes"] for r in rows] == [4 * floats * c.num_hidden_layers] * 3
    assert rows[-1]["kl"] > 1e-3  # the policy moved: an engine serving the base model would be far off
    assert rows[-1]["train_rollout_logprob_diff"] < 1e-4  # the engine serves what the trainer holds
    for step, groups in read_batches(tmp_path / "run" / "batches").items():
        samples = [s for g in groups for s in g.samples]
        names = {s.adapter for s in samples}  # one adapter per push, named for its version
        assert names == {None} if step == 1 else len(names) == 1 and names.pop().startswith(f"actor-v{step - 1}-")
        assert {v for s in samples for v in s.token_versions} == {step - 1}


def test_rl_train_with_lora_pushes_the_merged_weights_and_exports_a_peft_adapter(tiny_model_path, tmp_path):
    """`rl train` (no Ray): the engine gets W + (alpha / r) B A each step, every tensor's hash compared with the
    trainer's (weight_sync.verify: full); the trainer's and the engine's log-probs agree. ``--save-hf`` writes the
    merged checkpoint, which transformers loads as any, and the adapter, which peft loads over the original model:
    the same logits within 1e-5."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = small_run_config(tmp_path, "run", train={"num_steps": 3, "lora": {"rank": 8, "alpha": 16, "push": "merged"}},
                           weight_sync={"verify": "full", "verify_full_interval": 1}, ray={"enabled": False})
    p = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), "--save-hf", str(tmp_path / "hf")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert rows[-1]["train_rollout_logprob_diff"] < 1e-4  # the engine serves what the trainer holds
    ids = torch.tensor([[1, 264, 263, 201, 284, 324, 5, 17, 42]])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        want, before = merged(input_ids=ids).logits, base(input_ids=ids).logits
    adapted = PeftModel.from_pretrained(base, tmp_path / "hf" / "adapter").eval()
    config = json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        8, 16, sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        got = adapted(input_ids=ids).logits
    assert (want - before).abs().max() > 1e-3  # the adapters moved the model
    assert (got - want).abs().max() < 1e-5


def test_rl_train_trains_two_adapters_at_once_each_on_its_own_prompts_and_rewards(tiny_model_path, tmp_path):
    """Multi-LoRA (``train.lora.adapters``), `rl train` without Ray: adapter ``add`` on addition prompts scored by
    ``digits``, ``sub`` on subtraction scored by ``exact_match``; each step draws two prompts of each, one engine
    samples both adapters, each request naming its own adapter's version (``<name>-vN-<hex>``), and the trainer's
    log-probs match the engine's for both although the adapters moved far (lr 1e-2); a push moves both adapters'
    bytes (disk: each in its own folder of the version); --save-hf writes the base model unchanged and a peft adapter
    per name, which differ."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlx.data.replay import read_batches
    from rlx.tasks import arithmetic, write_jsonl

    add = write_jsonl(arithmetic(20, seed=1, ops="+"), tmp_path / "add.jsonl")
    sub = write_jsonl(arithmetic(20, seed=2, ops="-"), tmp_path / "sub.jsonl")
    cfg = small_run_config(
        tmp_path, "run", data={"path": None},
        rollout={"n_prompts": 4, "save_batches": True},
        train={"num_steps": 3, "optim": {"lr": 1e-2}, "objective": {"kl_coef": 0.01},
               "lora": {"rank": 8, "alpha": 16, "adapters": [
                   {"name": "add", "data": {"path": str(add)}},
                   {"name": "sub", "data": {"path": str(sub)}, "rewards": ["exact_match"]}]}},
        eval={"interval": 3, "at_start": False, "datasets": [
            {"name": "add", "path": str(add), "max_prompts": 4, "adapter": "add"},
            {"name": "base", "path": str(add), "max_prompts": 4}]},
        weight_sync={"transport": {"name": "disk"}},  # (a folder per adapter and version; tensor: the example's)
        ray={"enabled": False})
    p = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), "--save-hf", str(tmp_path / "hf")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    c = AutoConfig.from_pretrained(tiny_model_path)
    h, q, kv, i = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.intermediate_size
    floats = 8 * (6 * h + i) + 8 * (q + 2 * kv + h + 2 * i + h)  # one adapter's, per layer (as the test above)
    assert [r["weight_sync/bytes"] for r in rows] == [2 * 4 * floats * c.num_hidden_layers] * 3
    assert all(r["lora/add/samples"] == r["lora/sub/samples"] == 4 for r in rows)  # two prompts of each, n = 2
    assert rows[-1]["kl"] > 1e-3  # the adapters moved the policy
    assert rows[-1]["train_rollout_logprob_diff"] < 1e-4  # the engine serves each adapter as the trainer holds it
    for step, groups in read_batches(tmp_path / "run" / "batches").items():
        for s in (s for g in groups for s in g.samples):
            assert s.lora == ("add" if "+" in s.prompt_text else "sub")
            assert set(s.rewards) == {"digits" if s.lora == "add" else "exact_match"}
            assert s.adapter is None if step == 1 else s.adapter.startswith(f"{s.lora}-v{step - 1}-")
    evals = {r["dataset"]: r for r in map(json.loads, (tmp_path / "run" / "eval.jsonl").read_text().splitlines())}
    assert set(evals) == {"add", "base"}
    loaded = {}
    for f in Path(tiny_model_path).glob("*.safetensors"):
        loaded.update(load_file(f))
    exported = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(f))
    assert all(torch.equal(exported[n], t.to(exported[n].dtype)) for n, t in loaded.items())  # the base, frozen
    ids = torch.tensor([[1, 264, 263, 201, 284, 324, 5, 17, 42]])
    logits = {}
    for name in ("add", "sub"):
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
        with torch.no_grad():
            logits[name] = PeftModel.from_pretrained(base, tmp_path / "hf" / f"adapter-{name}").eval()(
                input_ids=ids).logits
    assert (logits["add"] - logits["sub"]).abs().max() > 1e-3  # two adapters, trained apart
    # `rl eval` of the run's checkpoint serves each adapter as exported beside the base (`serve_exported_adapters`,
    # tests/unit/test_evaluate.py): the answers of the run's last evaluation (greedy, the same weights)
    answers = {d: (tmp_path / "run" / "eval_samples" / "step_3" / f"{d}.jsonl").read_text() for d in ("add", "base")}
    p = subprocess.run([sys.executable, "-m", "rlx_cli.main", "eval", str(cfg), "--checkpoint",
                        str(tmp_path / "run" / "checkpoints")], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    again = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()][-2:]
    assert {r["dataset"]: (r["step"], r["pass@1"]) for r in again} == {
        d: (3, evals[d]["pass@1"]) for d in ("add", "base")}
    assert {d: (tmp_path / "run" / "eval_samples" / "step_3" / f"{d}.jsonl").read_text() for d in answers} == answers


def test_two_adapters_train_together_as_each_alone_and_at_tp2_as_in_one_process(tiny_model_path, tmp_path):
    """Multi-LoRA in the trainer: adapters ``a`` and ``b`` take the four groups in turn; two steps of both at TP=2 equal
    one process; and ``a``, trained beside ``b`` in one step (one optimizer; gradient clipping off, the one thing
    adapters share), ends exactly as the one adapter trained on ``a``'s groups alone: its loss is the mean over its own
    samples, its gradient from its micro-batches only, its Adam moments its own. (Its samples fall into the same two
    mini-batches either way: the step's samples are cut every other one, and b's groups shift a's by an even count.)"""
    two = {**LORA, "adapters": [{"name": "a", "data": {"path": "a.jsonl"}}, {"name": "b", "data": {"path": "b.jsonl"}}]}
    optim = {"clip_grad": 0.0}
    both = run(tmp_path, tiny_model_path, 1, lora=two, optim=optim)
    assert both["m1"]["lora/params"] == 2 * 8192
    assert_same(run(tmp_path, tiny_model_path, 2, tp=2, lora=two, optim=optim), both, KEYS)
    alone = run(tmp_path, tiny_model_path, 1, lora=LORA, optim=optim, groups=[0, 2])
    factors = {n: w for n, w in alone["weights"].items() if ".lora_" in n}
    assert len(factors) == 2 * 2 * 7  # two layers, seven projections, A and B
    for name, w in factors.items():
        got = both["weights"]["a@" + name]
        assert max(abs(x - y) for x, y in zip(got, w, strict=True)) < 1e-5, name
    assert all(both["weights"]["b@" + n] != both["weights"]["a@" + n] for n in factors)  # b trained on its own groups

"""megatron-core on CPU through rlx.train.megatron_patches.cpu, in a subprocess (the shim changes torch
globally, so it never runs inside the test process itself)."""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent("""
    import os, sys, torch, warnings
    warnings.filterwarnings("ignore")
    from rlx.train.megatron_patches.cpu import enable
    assert enable() is True
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(1, 1)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(1)
    from megatron.core.distributed import DistributedDataParallel as DDP, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from transformers import AutoModelForCausalLM
    from rlx.config import ParallelConfig
    from rlx.plugins import build_plugins
    from rlx.train.spec import HFCheckpoint, Stage

    hf = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
    spec = build_plugins().bridge_for(hf.config.model_type).spec(hf.config)
    stage = Stage(0, spec.num_layers, True, True)
    cfg = spec.transformer_config(ParallelConfig(), torch.float32)
    m = spec.build(cfg, stage)
    sd = dict(spec.to_megatron(HFCheckpoint(sys.argv[1]), stage))
    m.load_state_dict(sd, strict=True)
    a, c = [1, 264, 263, 201, 284, 324], [300, 301, 302, 5, 9]
    seg = torch.tensor([0] * len(a) + [1] * len(c))
    S = len(seg)
    mask = ~((seg[:, None] == seg[None, :]) & torch.ones(S, S, dtype=torch.bool).tril())[None, None]
    with torch.no_grad():
        packed = m(torch.tensor([a + c]), torch.arange(S)[None], attention_mask=mask)[0]
        ra, rc = hf(torch.tensor([a])).logits[0], hf(torch.tensor([c])).logits[0]
    print("packed_err", max((packed[:len(a)] - ra).abs().max().item(), (packed[len(a):] - rc).abs().max().item()))
    msd = m.state_dict()
    back = dict(spec.to_hf(stage, lambda name: [msd[name]]))
    ref = hf.state_dict()
    assert set(back) == set(ref) - ({"lm_head.weight"} if spec.tied else set()), set(ref) ^ set(back)
    print("roundtrip_err", max((back[k] - ref[k]).abs().max().item() for k in back))

    ddp = DDP(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), m)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True,
                                                 clip_grad=1.0, params_dtype=torch.float32), [ddp])
    w0 = m.decoder.layers[0].mlp.linear_fc1.weight.detach().clone()
    ddp.zero_grad_buffer(); opt.zero_grad()
    ddp(torch.tensor([a]), torch.arange(len(a))[None], attention_mask=None).logsumexp(-1).mean().backward()
    ddp.finish_grad_sync()
    ok, norm, _ = opt.step()
    print("step", ok, norm > 0, (m.decoder.layers[0].mlp.linear_fc1.weight - w0).abs().max().item() > 0)
    # the shim leaves transformers' model loading intact in the same process
    again = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    print("inv_freq_ok", bool(torch.allclose(again.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)))
""")


def other_family(kind: str, folder) -> str:
    """A small random Qwen2 (qkv bias, tied) or Llama (untied lm_head) checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **shape))
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **shape))
    for p in model.parameters():  # make biases and norms non-trivial so that a wrong mapping shows
        torch.nn.init.normal_(p, std=0.1)
    model.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_gpt_model_matches_hf_and_trains_with_the_distributed_optimizer(tiny_model_path, tmp_path, family):
    from rlx.rollout.engines.launch import free_port

    path = tiny_model_path if family == "qwen3" else other_family(family, tmp_path / family)
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), path, str(free_port())], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert float(out["packed_err"]) < 1e-5  # two sequences packed in one row, block-diagonal attention
    assert float(out["roundtrip_err"]) == 0.0
    assert out["step"] == "True True True"
    assert out["inv_freq_ok"] == "True"


def test_enable_is_a_no_op_when_cuda_is_there(tmp_path):
    code = ("import torch; torch.cuda.is_available = lambda: True\n"
            "from rlx.train.megatron_patches.cpu import enable\n"
            "t = torch.Tensor.type\n"
            "print(enable(), torch.Tensor.type is t)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False", "True"], r.stderr


@pytest.mark.parametrize("order", ["rlx.train first", "rlx.train first, cuda", "megatron first", "rlx alone"])
def test_megatrons_jit_fuser_is_a_plain_decorator_on_cpu_and_torch_compile_is_not_imported(order):
    """`import rlx.train` makes megatron's jit_fuser (torch.compile) a no-op decorator on a CPU machine as megatron
    is imported: torch's compiler stays unimported (1.3 s of each trainer's start). On GPU machines megatron keeps
    its choice; megatron imported before rlx.train keeps compiled functions, and then dynamo is disabled instead.
    `import rlx` alone installs nothing (a process that does not train keeps megatron's choice)."""
    first = {"rlx.train first": "import rlx.train\n",
             "rlx.train first, cuda": "torch.cuda.is_available = lambda: True\nimport rlx.train\n",
             "megatron first": "import megatron.core\nimport rlx.train\n", "rlx alone": "import rlx\n"}[order]
    code = ("import sys, warnings, torch\nwarnings.filterwarnings('ignore')\n" + first +
            "from megatron.core.models.gpt import GPTModel\nfrom megatron.core import jit\n"
            "fuser = 'noop' if jit.jit_fuser is jit.noop_decorator else 'compile'\n"
            "dynamo = 'torch._dynamo' in sys.modules\n"
            "from rlx.train.megatron_patches import cpu\ncpu.no_compile()\n"
            "off = 'torch._dynamo' in sys.modules and sys.modules['torch._dynamo'].config.disable\n"
            "from megatron.core.activations import quick_gelu\nquick_gelu(torch.randn(8, 8))\n"
            "frames = sys.modules['torch._dynamo'].utils.counters['frames'] if dynamo else {}\n"
            "print(fuser, dynamo, off, sum(frames.values()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == {"rlx.train first": ["noop", "False", "False", "0"],
                                "rlx.train first, cuda": ["compile", "True", "True", "0"],
                                "megatron first": ["compile", "True", "True", "0"],
                                "rlx alone": ["compile", "True", "True", "0"]}[order]  # nothing compiled


DEEP = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from rlx.config import parse_config
    from rlx.plugins import build_plugins
    from rlx.train.trainer import Trainer
    from rlx.types import Sample

    model, fillers = sys.argv[1], int(sys.argv[2])
    cfg = parse_config(json.dumps({"model": {"path": model}, "train": {"max_tokens_per_micro_batch": 10 ** 6}}))
    trainer = Trainer(cfg, build_plugins())
    g = torch.Generator().manual_seed(0)

    def sample(sid, n):
        prompt, response = (torch.randint(3, 500, (n,), generator=g).tolist() for _ in range(2))
        return Sample(prompt, response, [1] * n, sample_id=sid)

    fill = [sample(i, 60) for i in range(fillers)]
    b = sample(-1, 20)
    packed = trainer.step_fn.logprobs(trainer.actor, fill + [b])[-1]  # one row: b starts at position 120 * fillers
    alone = trainer.step_fn.logprobs(trainer.actor, [b])[-1]
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(trainer.model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([b.prompt_ids + b.response_ids])
        ref = torch.log_softmax(hf(ids).logits[0, len(b.prompt_ids) - 1:-1], -1)
    ref = ref.gather(-1, torch.tensor(b.response_ids)[:, None])[:, 0]
    print(json.dumps({"packed": (packed - alone).abs().max().item(), "hf": (alone - ref).abs().max().item()}))
""")


def test_a_sample_deep_in_a_long_row_gets_the_log_probs_it_gets_alone(tmp_path):
    """A micro-batch is one row by default: the sample after 250 others starts 30,000 positions in. Each sample's
    queries and keys are rotated for its own positions (from 0, as the engine does), so its log-probs equal those
    of the sample alone, and transformers'. Rotated by their place in the row instead (megatron's default), the
    angles carry the rounding of position 30,000 and the log-probs differ by about 2e-5."""
    script = tmp_path / "deep.py"
    script.write_text(DEEP)
    r = subprocess.run([sys.executable, str(script), "builtin://tiny-qwen3", "250"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["packed"] < 1e-6, out
    assert out["hf"] < 1e-4, out


TEAMS = textwrap.dedent("""
    import json, os, sys, time, warnings
    warnings.filterwarnings("ignore")
    import torch
    from rlx.config import parse_config
    from rlx.plugins import build_plugins
    from rlx.train.trainer import Trainer
    from rlx.types import Group, RolloutBatch, Sample, SampleStatus

    cfg = parse_config(json.dumps({"model": {"path": "builtin://tiny-qwen3"}, "cpu": {"threads": 2}}))
    trainer = Trainer(cfg, build_plugins())
    g = torch.Generator().manual_seed(0)
    groups = [Group(p, [Sample(torch.randint(3, 500, (24,), generator=g).tolist(),
                               torch.randint(3, 500, (16,), generator=g).tolist(), [1] * 16, [-6.0] * 16,
                               reward=float(i % 2), status=SampleStatus.COMPLETED, sample_id=8 * p + i, group_id=p)
                        for i in range(8)]) for p in range(4)]
    torch.ones(10 ** 6).mul_(2)  # this thread's OpenMP team
    time.sleep(0.5)  # the team of the matmul kernel's measuring thread (ended) is gone
    before = len(os.listdir("/proc/self/task"))
    for step in (1, 2):
        trainer.train_step(RolloutBatch(step, groups))
    print(json.dumps({"before": before, "after": len(os.listdir("/proc/self/task")),
                      "threads": torch.get_num_threads()}))
""")


def test_a_train_step_starts_no_openmp_threads_beside_its_own(tmp_path):
    """One data-parallel rank: megatron's parameter all-gather after the optimizer step copies the whole buffer
    onto itself on gloo's thread, where torch starts a second OpenMP team; with more OpenMP threads than cores,
    libgomp makes waiting threads sleep at once and every later parallel op waits for a wake-up (the tiny model's
    step: 50 -> 37 ms without it). Counted as the process's threads, which such a team adds to."""
    script = tmp_path / "teams.py"
    script.write_text(TEAMS)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["threads"] == 2, out
    assert out["after"] <= out["before"], out

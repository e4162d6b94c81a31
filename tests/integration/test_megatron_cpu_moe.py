"""The CPU shim's additions for mixture-of-experts, expert parallelism and latent attention: each is
needed (the script shows the failure without it) and sufficient (the same call works with it). In
subprocesses, since the shim changes torch globally."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

FIXES = ("stub_cuda_streams", "fix_router_gemm", "list_split_sizes", "no_te_in_mla", "no_compile")

PRELUDE = textwrap.dedent("""
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import rlx.train.megatron_patches.cpu as mc
    FIXES = %r
    real = {n: getattr(mc, n) for n in FIXES}
    skip = set(sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else set()
    for n in skip:
        setattr(mc, n, lambda: None)  # enable() without this fix
    mc.enable()
    import torch.distributed as dist
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    ep = dist.get_world_size()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(1)
    results = {}

    def attempt(name, fn):
        try:
            results[name] = ["ok", fn()]
        except Exception as e:
            results[name] = [type(e).__name__, str(e).splitlines()[0][:300]]
""" % (FIXES,))

EACH = PRELUDE + textwrap.dedent("""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    moe = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=4, moe_router_topk=2,
                            moe_token_dispatcher_type="alltoall", use_cpu_initialization=True, add_bias_linear=False)

    def dispatch():
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D
        D.cuda_dtoh_stream = None  # a class-level cache: an earlier dispatcher would hide the failure
        d = D(num_local_experts=4, local_expert_indices=[0, 1, 2, 3], config=moe,
              pg_collection=get_default_pg_collection())
        rmap = torch.zeros(6, 4, dtype=torch.bool)
        rmap[:, :2] = True
        return list(d.dispatch_preprocess(torch.randn(6, 8), rmap, torch.rand(6, 4))[0].shape)

    def router():
        from megatron.core.transformer.moe import moe_utils
        return list(moe_utils.router_gating_linear(torch.randn(3, 8), torch.randn(4, 8, requires_grad=True), None,
                                                   torch.float32).shape)

    mla = MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
                               qk_pos_emb_head_dim=4, v_head_dim=8, rope_type="rope", normalization="RMSNorm",
                               add_bias_linear=False, use_cpu_initialization=True)

    def mla_attention():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import build_module
        from rlx.train.attention import SDPACoreAttention
        spec = get_gpt_layer_local_spec(multi_latent_attention=True).submodules.self_attention
        spec.submodules.core_attention = SDPACoreAttention
        return type(build_module(spec, config=mla, layer_number=1)).__name__

    def local_attention_with_k_channels():
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType
        DotProductAttention(config=mla, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                            k_channels=12, v_channels=8)

    attempt("streams_before", dispatch)
    real["stub_cuda_streams"]()
    attempt("streams_after", dispatch)
    attempt("router_before", router)
    real["fix_router_gemm"]()
    attempt("router_after", router)
    attempt("local_attention", local_attention_with_k_channels)
    attempt("mla_before", mla_attention)
    real["no_te_in_mla"]()
    attempt("mla_after", mla_attention)
    from megatron.core import jit
    from megatron.core.activations import quick_gelu
    quick_gelu(torch.randn(8, 8))  # a jit_fuser function: as torch.compile's, it would compile for tens of seconds
    # `import rlx.train` made jit_fuser a no-op as megatron was imported (rlx.train.megatron_patches.jit): no compiler at all
    results["compile"] = [jit.jit_fuser is jit.noop_decorator, "torch._dynamo" in sys.modules]
    print("RESULTS", json.dumps(results))
""")

EP = PRELUDE + textwrap.dedent("""
    # A small MoE GPT: every rank runs forward and backward with the alltoall dispatcher; with EP=2 each rank
    # holds two of the four experts, loaded from the same full set, so losses and gradients must equal EP=1's.
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=4,
                            moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_ffn_hidden_size=16,
                            normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, moe_aux_loss_coeff=0.0,
                            expert_model_parallel_size=ep, variable_seq_lengths=True)
    model = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False), vocab_size=64,
                     max_sequence_length=16, position_embedding_type="rope")
    g = torch.Generator().manual_seed(0)
    # the full model's weights (all four experts), the same on every rank
    shapes = {k: v.shape for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    for k in list(shapes):
        if ".local_experts.0." in k:
            for e in range(4):
                shapes[k.replace(".local_experts.0.", f".local_experts.{e}.")] = shapes[k]
    full = {k: torch.randn(shapes[k], generator=g) * 0.2 for k in sorted(shapes)}
    per = 4 // ep  # rank r holds experts r*per .. r*per+per-1 as local 0 .. per-1
    mine = {}
    for k in model.state_dict():
        if k.endswith("_extra_state"):
            continue
        if ".local_experts." in k:
            head, rest = k.split(".local_experts.")
            j, tail = rest.split(".", 1)
            mine[k] = full[f"{head}.local_experts.{dist.get_rank() * per + int(j)}.{tail}"]
        else:
            mine[k] = full[k]

    def attempt_train():
        model.load_state_dict(mine, strict=False)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))  # the same on every rank
        logits = model(ids, torch.arange(8).expand(2, 8), None)
        loss = logits.float().logsumexp(-1).mean()
        loss.backward()
        return [loss.item()]
    attempt("train", attempt_train)
    if dist.get_rank() == 0:  # one writer: two ranks' lines can interleave on the shared stdout
        print("RESULTS", json.dumps(results), flush=True)
""")


def run(tmp_path, script, skip=(), nproc=1):
    from rlx.rollout.engines.launch import free_port

    path = tmp_path / "s.py"
    path.write_text(script)
    port = str(free_port())
    if nproc == 1:
        cmd = [sys.executable, str(path), port, ",".join(skip)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}",
               "--master-addr=127.0.0.1", str(path), port, ",".join(skip)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, r.stderr[-3000:]
    return json.loads(lines[0][len("RESULTS "):])


def test_each_fix_is_needed_and_works(tmp_path):
    got = run(tmp_path, EACH, skip=FIXES)
    assert got["streams_before"][0] == "RuntimeError" and "torch.cuda.Stream" in got["streams_before"][1]
    assert got["streams_after"][0] == "ok"
    assert got["router_before"] == ["NameError", "name 'te_general_gemm' is not defined"]
    assert got["router_after"] == ["ok", [3, 4]]
    assert got["local_attention"][0] == "TypeError" and "k_channels" in got["local_attention"][1]
    assert got["mla_before"][0] == "TypeError" and "isinstance" in got["mla_before"][1]
    assert got["mla_after"] == ["ok", "MLASelfAttention"]
    assert got["compile"] == [True, False]  # (megatron imported before rlx: test_megatron_cpu.py)


def test_expert_parallel_over_gloo_needs_list_split_sizes_and_matches_one_process(tmp_path):
    one = run(tmp_path, EP)["train"]
    assert one[0] == "ok", one
    without = run(tmp_path, EP, skip=("list_split_sizes",), nproc=2)["train"]
    assert without[0] == "TypeError" and "all_to_all_single" in without[1]
    two = run(tmp_path, EP, nproc=2)["train"]
    assert two[0] == "ok", two
    assert two[1][0] == pytest.approx(one[1][0], abs=1e-5)  # the same loss with the experts split over 2 ranks

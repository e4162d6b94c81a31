"""Command lines rlx builds for SGLang, the embedded engine and sglang-router, from config."""

import asyncio
import json
import sys

import pytest

from rlx.config import parse_config
from rlx.errors import RLXError
from rlx.rollout.engines.client import EngineError
from rlx.rollout.engines.fleet import EngineFleet
from rlx.rollout.engines.launch import ManagedProcess, flags, wait_healthy
from rlx.rollout.engines.router import router_command


def test_flags_pass_through_server_args():
    assert flags({"chunked_prefill_size": 4096, "enable_x": True, "off": False, "none": None,
                  "cuda_graph_bs": [1, 2]}) == ["--chunked-prefill-size", "4096", "--enable-x",
                                                "--cuda-graph-bs", "1", "2"]


def test_sglang_command_from_a_topology_group(tmp_path):
    cfg = parse_config("""
model: {path: /models/qwen}
ray: {gpus_per_engine: 1}  # engines placed on GPUs: no CPU flags
rollout:
  engines:
    - {name: p, backend: sglang, tp_size: 2, mem_fraction_static: 0.7, worker_type: prefill,
       server_args: {disaggregation_bootstrap_port: 8998}}
    - {name: d, backend: sglang, model_path: /models/other, worker_type: decode, update_weights: false}
""")
    fleet = EngineFleet(cfg, tmp_path)
    p, d = cfg.rollout.engines
    cmd = fleet._command(p, "127.0.0.1", 30001)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert cmd[3:] == ["--model-path", "/models/qwen", "--host", "127.0.0.1", "--port", "30001", "--tp-size", "2",
                       "--mem-fraction-static", "0.7", "--disaggregation-mode", "prefill",
                       "--disaggregation-bootstrap-port", "8998"]
    assert fleet._command(d, "127.0.0.1", 30002)[4] == "/models/other"
    assert "--disaggregation-mode" in fleet._command(d, "127.0.0.1", 30002)
    # an engine placed on another host binds that host's address
    cmd = fleet._command(d, "10.1.2.3", 30003)
    assert cmd[cmd.index("--host") + 1] == "10.1.2.3"


def _model_folder(tmp_path, **config):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    return str(tmp_path / "m")


def test_sglang_on_a_cpu_gets_its_flags_a_bounded_kv_pool_and_its_own_interpreter(tmp_path, monkeypatch):
    path = _model_folder(tmp_path, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         hidden_size=32, max_position_embeddings=4096)  # head_dim 8: 2*2*2*8*4 = 256 B a token
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "run.yaml").write_text(f"""
model: {{path: {path}}}
ray: {{enabled: false}}
rollout:
  n_prompts: 8
  n_samples_per_prompt: 4
  sampling: {{max_new_tokens: 64}}
  engines: [{{backend: sglang, python: ../sglang/bin/python}}, {{name: b, backend: sglang}}]
""")
    from rlx.config import load_config

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    cfg = load_config(tmp_path / "cfg" / "run.yaml")
    a, b = cfg.rollout.engines
    assert a.python == str(tmp_path / "sglang" / "bin" / "python")  # relative to the config file, link kept
    fleet = EngineFleet(cfg, tmp_path)
    cmd = fleet._command(a, "127.0.0.1", 1)
    assert cmd[0] == a.python and fleet._command(b, "127.0.0.1", 1)[0] == sys.executable
    arg = lambda k: cmd[cmd.index(k) + 1]  # noqa: E731
    # 32 requests over 2 engines: 16 x (512 + 64) = 9216 tokens, more than the 4096 context
    assert arg("--device") == "cpu" and "--disable-overlap-schedule" in cmd and arg("--max-total-tokens") == "9216"
    assert "--sleep-on-idle" in cmd
    assert arg("--dtype") == "float32"  # as the trainer on a CPU
    assert fleet._env(a)["SGLANG_USE_CPU_ENGINE"] == "1"
    assert fleet._env(a)["RLX_SGLANG_NO_AMX"] == "1"  # fp32: SGLang's AMX kernels hold none
    # a quarter of the free memory, over 2 engines, at 256 B a token: 1000 tokens, raised to the 1024 floor
    monkeypatch.setattr("rlx.rollout.engines.launch._mem_available", lambda: 4 * 2 * 256 * 1000)
    cmd = fleet._command(a, "127.0.0.1", 1)
    assert arg("--max-total-tokens") == "1024"
    monkeypatch.setattr("rlx.rollout.engines.launch._mem_available", lambda: 4 * 2 * 256 * 3000)
    cmd = fleet._command(a, "127.0.0.1", 1)
    assert arg("--max-total-tokens") == "3000"
    # placed by Ray on bundles without GPUs, it is on a CPU too
    cfg.ray.enabled = True
    assert "--device" in fleet._command(b, "127.0.0.1", 1)
    cfg.ray.enabled = False
    # a group's own server_args win; a GPU machine gets none of this
    cfg.rollout.engines[0].server_args = {"max_total_tokens": 500}
    cmd = fleet._command(a, "127.0.0.1", 1)
    assert arg("--max-total-tokens") == "500"
    cfg.rollout.engines[0].server_args = {"dtype": "bfloat16"}  # AMX kernels welcome
    assert "RLX_SGLANG_NO_AMX" not in fleet._env(a)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    cmd = fleet._command(b, "127.0.0.1", 1)
    assert "--device" not in cmd and "--max-total-tokens" not in cmd and "--dtype" not in cmd
    assert "SGLANG_USE_CPU_ENGINE" not in fleet._env(b) and "RLX_SGLANG_NO_AMX" not in fleet._env(b)


def test_routing_replay_on_sglang_on_a_cpu_is_refused_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    path = _model_folder(tmp_path, num_hidden_layers=2, num_attention_heads=4, hidden_size=32)
    cfg = parse_config(f"model: {{path: {path}}}\nray: {{enabled: false}}\n"
                       "rollout: {routed_experts: true, engines: [{backend: sglang}]}")
    with pytest.raises(RLXError, match=r"routing replay .* cannot run on SGLang on a CPU: .* pins through CUDA"):
        EngineFleet(cfg, tmp_path)._command(cfg.rollout.engines[0], "127.0.0.1", 1)


def test_run_deterministic_asks_each_engine_for_deterministic_inference_and_refuses_sglang_on_a_cpu(
        tmp_path, monkeypatch):
    """The embedded engine gets --enable-deterministic-inference (its own seed, which differs by port, then serves no
    request: each carries its sampling_seed); SGLang gets the flag on a GPU, and on a CPU, where its deterministic
    attention backends do not run, the run is refused with the reason."""
    path = _model_folder(tmp_path, num_hidden_layers=2, num_attention_heads=4, hidden_size=32)
    cfg = parse_config(f"model: {{path: {path}}}\nray: {{enabled: false}}\nrun: {{seed: 9, deterministic: true}}\n"
                       "rollout: {engines: [{name: e}, {name: s, backend: sglang}]}")
    fleet = EngineFleet(cfg, tmp_path)
    embedded, sglang = cfg.rollout.engines
    for port in (1, 2):
        cmd = fleet._command(embedded, "127.0.0.1", port)
        assert "--enable-deterministic-inference" in cmd and cmd[cmd.index("--random-seed") + 1] == str(9 + port)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert "--enable-deterministic-inference" in fleet._command(sglang, "127.0.0.1", 1)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(RLXError, match=r"run.deterministic cannot run on SGLang on a CPU: .* GPU attention backend"):
        fleet._command(sglang, "127.0.0.1", 1)
    cfg.run.deterministic = False
    assert "--enable-deterministic-inference" not in fleet._command(embedded, "127.0.0.1", 1)


def test_an_interpreter_for_the_embedded_engine_is_refused():
    from rlx.errors import ConfigError

    with pytest.raises(ConfigError, match="python: names the interpreter of SGLang servers"):
        parse_config("model: {path: /m}\nrollout: {engines: [{python: /usr/bin/python3}]}")


def test_sglang_servers_get_what_the_model_family_needs(tmp_path, tiny_model_path, monkeypatch):
    import types

    from rlx import hookimpl
    from rlx.plugins import build_plugins
    from rlx.rollout.session import family_engine_args

    class Spec:
        def engine_args(self):
            return {"enable_return_routed_experts": True, "chunked_prefill_size": 1}

    class Bridge:
        name = "routed"
        model_types = ("qwen3",)

        def spec(self, hf_config):
            from rlx.builtins.models import DecoderSpec

            return type("RoutedSpec", (DecoderSpec,), {"engine_args": Spec.engine_args})(
                model_type="qwen3", hf_config=hf_config, num_layers=2, vocab_size=8, hidden_size=4,
                max_positions=8, tied=True, flops=None)

    monkeypatch.setenv("RLX_DISABLE_PLUGINS", "rlx.builtins.models")
    mod = types.ModuleType("routed")
    mod.register_models = hookimpl(lambda register: register(Bridge))
    plugins = build_plugins(entry_points=False, extra=[("routed", mod)])
    cfg = parse_config(f"model: {{path: {tiny_model_path}}}\n"
                       "rollout: {engines: [{backend: sglang, server_args: {chunked_prefill_size: 8}}]}")
    fleet = EngineFleet(cfg, tmp_path, engine_args=lambda path: family_engine_args(path, plugins))
    cmd = fleet._command(cfg.rollout.engines[0], "127.0.0.1", 1)
    assert "--enable-return-routed-experts" in cmd and cmd[cmd.index("--chunked-prefill-size") + 1] == "8"
    # generation alone needs no bridge: a family nobody claims gets no extra arguments, not an error
    assert family_engine_args(tiny_model_path, build_plugins(entry_points=False)) == {}


def test_embedded_group_refuses_what_it_cannot_do(tmp_path):
    cfg = parse_config("model: {path: /m}\nrollout: {engines: [{worker_type: decode}, {tp_size: 2}]}")
    fleet = EngineFleet(cfg, tmp_path)
    with pytest.raises(RLXError, match="no decode mode"):
        fleet._command(cfg.rollout.engines[0], "127.0.0.1", 1)
    with pytest.raises(RLXError, match="one device"):
        fleet._command(cfg.rollout.engines[1], "127.0.0.1", 1)


def test_router_commands_regular_and_pd():
    cmd = router_command(9000, "round_robin", worker_urls=["http://a"])
    assert cmd[cmd.index("--policy") + 1] == "round_robin" and cmd[cmd.index("--worker-urls") + 1] == "http://a"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--prometheus-host") + 1] == "127.0.0.1"
    pd = router_command(9000, "cache_aware", prefill_urls=["http://p"], decode_urls=["http://d"])
    assert "--pd-disaggregation" in pd and pd[pd.index("--prefill") + 1] == "http://p"
    assert pd[pd.index("--decode") + 1] == "http://d"


def test_a_server_that_exits_at_start_is_reported_with_its_log(tmp_path):
    proc = ManagedProcess([sys.executable, "-c", "import sys; print('no such model: /x'); sys.exit(3)"],
                          tmp_path / "e.log")
    proc.start()
    with pytest.raises(EngineError, match=r"exited with code 3 before it was healthy(.|\n)*no such model: /x"):
        asyncio.run(wait_healthy("http://127.0.0.1:9", proc, 30))


def test_a_server_that_never_answers_times_out(tmp_path):
    proc = ManagedProcess([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "e.log")
    proc.start()
    try:
        with pytest.raises(EngineError, match="not healthy after 1s"):
            asyncio.run(wait_healthy("http://127.0.0.1:9", proc, 1))
    finally:
        proc.stop()
    assert not proc.alive()


def test_free_ports_lie_outside_the_kernels_ephemeral_range_and_are_not_handed_out_twice(monkeypatch):
    """A port from bind(0) can be taken as some connection's source port before the engine binds it (it
    binds after loading its model): rlx's ports come from outside the ephemeral range and Ray's worker ports."""
    import socket

    from rlx import net

    lo, hi = net._ephemeral_range()
    ports = [net.free_port() for _ in range(300)]
    assert len(set(ports)) == 300
    assert all(20000 <= p <= 65535 and not lo <= p <= hi for p in ports)
    with socket.socket() as s:  # each was free when handed out
        s.bind(("127.0.0.1", ports[-1]))
    # an ephemeral range that leaves nothing outside it: the kernel's pick
    monkeypatch.setattr(net, "_ephemeral_range", lambda: (1024, 65535))
    assert 0 < net.free_port() <= 65535
    # a port something else holds is never handed out
    monkeypatch.setattr(net, "_ephemeral_range", lambda: (20001, 65535))  # one candidate left: 20000
    net._given.discard(20000)
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", 20000))
        except OSError:
            pytest.skip("port 20000 is held by another process on this machine")
        s.listen()
        assert net.free_port() != 20000


def test_speculative_decoding_launch_options_for_each_method(tmp_path):
    """speculative: SGLang's flags, whose --speculative-num-draft-tokens counts the last token too; MTP drafts are
    its EAGLE chain over the checkpoint's MTP layers, a draft model its STANDALONE; the embedded engine takes each
    (drafting the same top-k-1 chain) and its command line parses them."""
    from rlx.rollout.engines.embedded.__main__ import parse_args

    cfg = parse_config(f"""
model: {{path: /models/glm}}
ray: {{gpus_per_engine: 1}}
rollout:
  engines:
    - {{name: e, speculative: {{method: ngram, num_draft_tokens: 3}}}}
    - {{name: n, backend: sglang, speculative: {{method: ngram}}}}
    - {{name: m, backend: sglang, speculative: {{method: mtp, num_draft_tokens: 2}}}}
    - {{name: d, backend: sglang, speculative: {{method: draft_model, draft_model: {tmp_path}/draft}}}}
    - {{name: ed, speculative: {{method: draft_model, draft_model: {tmp_path}/draft, num_draft_tokens: 2}}}}
    - {{name: em, speculative: {{method: mtp}}}}
""")
    fleet = EngineFleet(cfg, tmp_path)
    e, n, m, d, ed, em = (fleet._command(g, "127.0.0.1", 30001) for g in cfg.rollout.engines)

    def opts(cmd):
        return {a: b for a, b in zip(cmd, cmd[1:], strict=False) if a.startswith("--speculative")}

    assert opts(e) == {"--speculative-algorithm": "NGRAM", "--speculative-num-draft-tokens": "4"}
    args = parse_args(e[3:])
    assert args.speculative_algorithm == "NGRAM" and args.speculative_num_draft_tokens == 4
    assert opts(n) == {"--speculative-algorithm": "NGRAM", "--speculative-num-draft-tokens": "5"}
    assert opts(m) == {"--speculative-algorithm": "EAGLE", "--speculative-num-draft-tokens": "3",
                       "--speculative-num-steps": "2", "--speculative-eagle-topk": "1"}
    assert opts(d) == {"--speculative-algorithm": "STANDALONE", "--speculative-draft-model-path": f"{tmp_path}/draft",
                       "--speculative-num-draft-tokens": "5", "--speculative-num-steps": "4",
                       "--speculative-eagle-topk": "1"}
    assert opts(ed) == {"--speculative-algorithm": "STANDALONE", "--speculative-draft-model-path": f"{tmp_path}/draft",
                        "--speculative-num-draft-tokens": "3"}
    args = parse_args(ed[3:])
    assert args.speculative_algorithm == "STANDALONE" and args.speculative_draft_model_path == f"{tmp_path}/draft"
    assert opts(em) == {"--speculative-algorithm": "EAGLE", "--speculative-num-draft-tokens": "5"}
    assert parse_args(em[3:]).speculative_algorithm == "EAGLE"


def test_engines_that_get_adapters_are_launched_with_lora_and_sglang_on_a_cpu_is_refused(tmp_path, monkeypatch):
    path = _model_folder(tmp_path, num_hidden_layers=2, num_attention_heads=4, hidden_size=32)
    cfg = parse_config(f"model: {{path: {path}}}\nray: {{enabled: false}}\n"
                       "train: {lora: {rank: 8, target_modules: [q_proj, k_proj, v_proj]}}\n"
                       "rollout: {engines: [{name: e}, {name: s, backend: sglang}]}")
    fleet = EngineFleet(cfg, tmp_path)
    embedded, sglang = cfg.rollout.engines
    cmd = fleet._command(embedded, "127.0.0.1", 1)
    assert "--enable-lora" in cmd and cmd[cmd.index("--max-lora-rank") + 1] == "8"
    assert cmd[cmd.index("--lora-target-modules") + 1:][:3] == ["q_proj", "k_proj", "v_proj"]
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert "--enable-lora" in fleet._command(sglang, "127.0.0.1", 1)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(RLXError, match=r"SGLang 0.5.23 cannot serve LoRA adapters on a CPU .* backend: embedded"):
        fleet._command(sglang, "127.0.0.1", 1)
    cfg.train.lora.push = "merged"
    assert "--enable-lora" not in fleet._command(embedded, "127.0.0.1", 1)

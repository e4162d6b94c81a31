import textwrap

import pytest

from rlx.config import apply_override, format_path, load_config, parse_config
from rlx.errors import ConfigError
from rlx.plugins import build_plugins
from rlx.preflight import config_checks


def parse(text, overrides=(), plugins=None):
    return parse_config(textwrap.dedent(text), overrides=list(overrides), checks=config_checks(plugins))


def problems(text, overrides=(), plugins=None):
    with pytest.raises(ConfigError) as e:
        parse(text, overrides, plugins)
    return e.value.problems


def test_defaults_fill_the_tree():
    cfg = parse("model: {path: /m}")
    assert cfg.rollout.n_samples_per_prompt == 4
    assert cfg.rollout.generator.name == "single_turn"
    assert cfg.rollout.sampling.top_k == -1


def test_unknown_wrong_type_and_missing_are_collected_with_lines():
    got = problems("""
        run:
          outptu_dir: /x
        rollout:
          sampling:
            temperature: hot
    """)
    assert len(got) == 3
    assert ("<config>:3: run.outptu_dir", "unknown key (did you mean 'output_dir'?)") in got
    where = [w for w, _ in got]
    assert "<config>:6: rollout.sampling.temperature" in where
    assert any(w.endswith(": model") and m == "required, but missing" for w, m in got)


def test_unknown_top_level_section_lists_known_keys():
    (where, msg), = problems("model: {path: /m}\nzzz: 1\n")
    assert where == "<config>:2: zzz" and "known keys: run, model, data, rollout, train" in msg


def test_override_sets_typed_values_and_list_items():
    cfg = parse(
        """
        model: {path: /m}
        rollout:
          rewards: [exact_match]
        """,
        ["rollout.sampling.temperature=0.25", "rollout.rewards.0.weight=2", "rollout.sampling.stop=[a, b]"],
    )
    assert cfg.rollout.sampling.temperature == 0.25
    assert cfg.rollout.rewards[0].weight == 2.0
    assert cfg.rollout.sampling.stop == ["a", "b"]


def test_override_errors_name_the_override():
    got = problems("model: {path: /m}", ["rollout.n_prompts=lots", "nokey"])
    assert ("--set nokey", "expected KEY.PATH=VALUE") in got
    assert any(w == "--set rollout.n_prompts=lots: rollout.n_prompts" for w, _ in got)


def test_override_creates_missing_sections():
    cfg = parse("{}", ["model.path=/x"])
    assert cfg.model.path == "/x"


def test_apply_override_rejects_index_past_the_end():
    with pytest.raises(ValueError, match="no list item 5"):
        apply_override({"a": [1]}, "a.5.b=1")


def test_component_names_and_args_checked_against_plugins():
    got = problems(
        """
        model: {path: /m}
        rollout:
          generator: nope
          rewards:
            - {name: exact_match, args: {case_sensitive: maybe}}
        """,
        plugins=build_plugins(entry_points=False),
    )
    where = dict(got)
    assert "no generator named 'nope'" in where["<config>:4: rollout.generator.name"]
    assert "valid boolean" in where["<config>:6: rollout.rewards[0].args.case_sensitive"]


def test_critic_settings_without_a_critic_estimator_are_errors_not_silently_ignored():
    got = dict(problems(
        """
        model: {path: /m}
        train:
          objective: {kl_coef: 0.1, kl_in_reward: true}
          critic: {value_clip: 0.5, optim: {lr: 0.001}}
        """,
        plugins=build_plugins(entry_points=False),
    ))
    why = "applies to advantage estimators with a critic (gae); train.objective.advantage is 'grpo'"
    assert got["<config>:5: train.critic.value_clip"] == why
    assert got["<config>:5: train.critic.optim"] == why
    assert got["<config>:4: train.objective.kl_in_reward"] == why
    got = dict(problems("model: {path: /m}\ntrain: {objective: {advantage: gae, kl_in_reward: true}}",
                        plugins=build_plugins(entry_points=False)))
    assert got == {"<config>:2: train.objective.kl_in_reward": "needs a KL penalty: set kl_coef > 0"}
    assert parse("model: {path: /m}\ntrain: {objective: {advantage: gae}, critic: {warmup_steps: 2}}",
                 plugins=build_plugins(entry_points=False)).train.critic.warmup_steps == 2


def test_a_reward_listed_twice_is_an_error():
    got = dict(problems("model: {path: /m}\nrollout:\n  rewards: [digits, {name: digits, weight: 2}]\n"))
    assert got["<config>:3: rollout.rewards"].startswith(
        "Value error, reward 'digits' is listed twice; a reward's score is kept and logged under its name, so list "
        "each once")


def test_a_critic_placement_needs_a_critic_with_processes_of_its_own():
    got = dict(problems("model: {path: /m}\ntrain: {critic: {placement: own}}\n"))
    assert got["<config>:2: train.critic.placement"].startswith("places a critic with processes of its own")


def test_yaml_syntax_error_has_a_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  path: [unclosed\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert e.value.problems[0][0].startswith(f"{p}:")
    assert e.value.exit_code == 2


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    p = tmp_path / "sub" / "c.yaml"
    p.parent.mkdir()
    p.write_text("model: {path: m}\ndata: {path: d.jsonl}\n")
    cfg = load_config(p, ["run.output_dir=/abs/out"])
    # resolved when the file is loaded: workers elsewhere get absolute paths and never re-parse
    assert cfg.data.path == str(tmp_path / "sub" / "d.jsonl") and cfg.model.path == str(tmp_path / "sub" / "m")
    assert cfg.run.output_dir == "/abs/out"
    again = parse_config(cfg.to_json())
    assert again.data.path == cfg.data.path and again.model_dump() == cfg.model_dump()
    assert parse("model: {path: builtin://tiny-qwen3}").model.path == "builtin://tiny-qwen3"


def test_to_yaml_round_trips():
    cfg = parse("model: {path: /m}\nrollout: {rewards: [{name: exact_match, weight: 0.5}]}")
    again = parse(cfg.to_yaml())
    assert again.model_dump() == cfg.model_dump()


def test_format_path():
    assert format_path(("rollout", "rewards", 0, "args", "x")) == "rollout.rewards[0].args.x"
    assert format_path(()) == "<root>"


def test_override_into_a_component_given_by_name():
    cfg = parse("model: {path: /m}\nrollout: {generator: single_turn}", ["rollout.generator.args.x=1"])
    assert cfg.rollout.generator.name == "single_turn" and cfg.rollout.generator.args == {"x": 1}


def test_settings_of_the_other_training_mode_are_errors():
    with pytest.raises(ConfigError) as e:
        parse_config("model: {path: /m}\ntrain:\n  async: {swap: drain}\n")
    assert "<config>:3: train.async.swap: applies to train.mode: async only" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_config("model: {path: /m}\nrollout: {partial_rollout: {enabled: true}}\ntrain: {mode: async}\n")
    assert "rollout.partial_rollout.enabled: applies to sync mode" in str(e.value)
    cfg = parse_config("model: {path: /m}\ntrain: {mode: async, async: {swap: drain, max_staleness: 3}}\n")
    assert cfg.train.async_.swap == "drain" and cfg.train.async_.max_staleness == 3
    with pytest.raises(ConfigError) as e:
        parse_config("model: {path: /m}\ntrain: {mode: async}\nweight_sync: {interval: 2}\n")
    assert "train.async.max_staleness: must be at least weight_sync.interval (2)" in str(e.value)
    # run.deterministic's async mode is one step off the policy on a fixed schedule: the async knobs do not apply
    cfg = parse("model: {path: /m}\nrun: {deterministic: true}\ntrain: {mode: async}\nweight_sync: {interval: 2}\n")
    assert cfg.run.deterministic and cfg.train.mode == "async"
    assert parse(cfg.to_yaml()) == cfg  # its own dump loads back (every key written, at its default)
    got = problems("model: {path: /m}\nrun: {deterministic: true}\n"
                   "train: {mode: async, async: {swap: drain, max_staleness: 3}}\n")
    assert sorted(where for where, _ in got) == ["<config>:3: train.async.max_staleness",
                                                 "<config>:3: train.async.swap"]
    assert all(msg.startswith("does not apply under run.deterministic, whose async mode runs one step off")
               for _, msg in got)


def test_a_replay_needs_its_batches_sync_mode_and_no_evaluation():
    got = dict(problems("model: {path: /m}\nrollout: {source: replay}\ntrain: {mode: async}\n"
                        "eval: {datasets: [{name: h, path: h.jsonl}]}\n"))
    assert got["<config>:2: rollout.source"].startswith("replay trains on saved batches: set rollout.replay")
    assert got["<config>:3: train.mode"] == "a replay trains on saved batches, step by step: use sync"
    assert got["<config>:4: eval.datasets"] == "evaluation generates, and a replay starts no engines"
    [(where, msg)] = problems("model: {path: /m}\nrollout: {replay: runs/x/batches}\n")
    assert where == "<config>:2: rollout.replay" and msg == "applies to rollout.source: replay"


def test_trainer_offload_follows_the_engines_and_needs_them_to_offload():
    from rlx.config import trainer_offloads

    colocated = "model: {path: /m}\nray: {placement: colocated, gpus_per_trainer: 1}\n"
    assert trainer_offloads(parse_config(colocated)) and not trainer_offloads(parse_config("model: {path: /m}\n"))
    assert not trainer_offloads(parse_config(colocated + "rollout: {offload_during_train: false}\n"))
    assert trainer_offloads(parse_config("model: {path: /m}\ntrain: {offload: true}\n"))
    [(where, msg)] = problems("model: {path: /m}\ntrain: {mode: async, offload: true}\n")
    assert where == "<config>:2: train.offload" and msg.startswith("async mode trains while the engines generate")
    [(where, msg)] = problems("model: {path: /m}\nrollout: {offload_during_train: false}\ntrain: {offload: true}\n")
    assert where == "<config>:3: train.offload" and "which the engines must then have released" in msg


def test_quantisation_aware_training_needs_its_engines_and_int4_needs_the_embedded_engine():
    [(where, msg)] = problems("model: {path: /m}\ntrain: {qat: int4}\n")
    assert where == "<config>:2: train.qat" and msg.endswith("set rollout.quantization: int4 too (it is unset)")
    [(where, msg)] = problems("model: {path: /m}\nrollout: {quantization: fp8}\ntrain: {qat: int4}\n")
    assert where == "<config>:3: train.qat" and msg.endswith("(it is fp8)")
    [(where, msg)] = problems("model: {path: /m}\nrollout:\n  quantization: int4\n  engines:\n"
                              "    - {backend: sglang}\n")
    assert where == "<config>:5: rollout.engines[0].backend" and msg.startswith("INT4 rollout is served by the embedded")
    cfg = parse("model: {path: /m}\nrollout: {quantization: int4}\ntrain: {qat: int4}\n")
    assert (cfg.rollout.quantization, cfg.train.qat) == ("int4", "int4")
    [(where, msg)] = problems("model: {path: /m}\nrollout: {quantization: fp8}\nweight_sync: {transport: broadcast}\n")
    assert where == "<config>:3: weight_sync.transport" and "tensor transport only" in msg
    [(where, msg)] = problems("model: {path: /m}\ntrain: {fp8: e4m3}\n")  # FP8 training: refused with the reason
    assert where == "<config>:2: train.fp8" and "through Transformer Engine's layers" in msg


def test_lora_names_peft_targets_and_refuses_what_it_would_freeze():
    cfg = parse("model: {path: /m}\ntrain: {lora: {rank: 8}}\n")
    assert (cfg.train.lora.rank, cfg.train.lora.alpha, cfg.train.lora.target_modules[0]) == (8, 32.0, "q_proj")
    [(where, msg)] = problems("model: {path: /m}\ntrain: {lora: {target_modules: [qkv_proj]}}\n")
    assert where.endswith("train.lora.target_modules[0]") and "'q_proj'" in msg
    for key, value in (("qat", "int4"), ("objective", "{mtp_loss_coef: 0.1}"), ("objective", "{indexer_kl_coef: 1}")):
        found = problems(f"model: {{path: /m}}\nrollout: {{quantization: int4}}\ntrain: {{lora: {{}}, {key}: {value}}}\n")
        assert any("with train.lora:" in msg and "leave it off" in msg for _, msg in found), found


def test_unknown_key_in_the_async_section_suggests_the_close_one():
    with pytest.raises(ConfigError) as e:
        parse_config("model: {path: /m}\ntrain: {mode: async, async: {max_stalenes: 2}}\n")
    assert "train.async.max_stalenes: unknown key (did you mean 'max_staleness'?)" in str(e.value)


def test_eval_datasets_are_checked_like_the_rest_of_the_tree(tmp_path):
    got = dict(problems(
        """
        model: {path: /m}
        eval:
          interval: 5
          datasets:
            - {name: a, path: a.jsonl, rewards: [nope], n_samples: 0}
            - {name: a, path: b.jsonl, temperature: 0.5}
        """,
        plugins=build_plugins(entry_points=False),
    ))
    assert "greater than or equal to 1" in got["<config>:6: eval.datasets[0].n_samples"]
    assert "unknown key" in got["<config>:7: eval.datasets[1].temperature"]
    got = dict(problems("""
        model: {path: /m}
        eval: {datasets: [{name: a, path: a.jsonl, rewards: [exact_match, nope]}]}
        """, plugins=build_plugins(entry_points=False)))
    assert "no reward named 'nope'" in got["<config>:3: eval.datasets[0].rewards[1].name"]
    p = tmp_path / "c.yaml"
    p.write_text("model: {path: m}\neval: {datasets: [{name: a, path: a.jsonl}, {name: a, path: b.jsonl}]}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "dataset names must be unique" in str(e.value) and "['a']" in str(e.value)
    p.write_text("model: {path: m}\neval: {datasets: [{name: a, path: sub/a.jsonl}]}\n")
    assert load_config(p).eval.datasets[0].path == str(tmp_path / "sub" / "a.jsonl")


def test_a_group_goes_as_one_request_unless_prefill_decode_workers_serve_it():
    """rollout.requests.coalesce: on by default; off (and refused when asked for) with prefill/decode workers."""
    regular = parse_config("model: {path: /m}")
    assert regular.rollout.requests.coalesce is None and regular.rollout.coalesces
    assert not parse_config("model: {path: /m}\nrollout: {requests: {coalesce: false}}").rollout.coalesces
    pd = "model: {path: /m}\nrollout:\n  engines: [{name: p, worker_type: prefill}, {name: d, worker_type: decode}]\n"
    assert not parse_config(pd).rollout.coalesces
    with pytest.raises(ConfigError, match="requests.coalesce: with prefill/decode workers"):
        parse_config(pd + "  requests: {coalesce: true}\n")


def test_a_problem_is_located_where_it_was_given_and_checks_skip_what_a_refusal_took_out(tmp_path):
    """A --set that set the key or a mapping above it is named; a key the file gives keeps its line (a --set beside
    it does not take it over); a --set that made a key below is named where the file has no line. A section the
    schema refused whole is not checked further (its checks would only see defaults: an estimator without a critic
    flagging every train.critic key)."""
    from rlx.config import load_config
    from rlx.errors import ConfigError
    from rlx.plugins import build_plugins
    from rlx.preflight import config_checks

    p = tmp_path / "c.yaml"
    p.write_text("model: {path: builtin://tiny-qwen3}\ntrain:\n  num_steps: abc\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, ["train.optim.lr=x", "model.foo.bar=1"])
    assert sorted(w for w, _ in e.value.problems) == sorted(
        ["--set model.foo.bar=1: model.foo", f"{p}:3: train.num_steps", "--set train.optim.lr=x: train.optim.lr"])
    p.write_text("model: {path: builtin://tiny-qwen3}\ntrain:\n  objective: {advantage: gae, tis_low: 0.5}\n"
                 "  critic: {warmup_steps: 2}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, checks=config_checks(build_plugins(entry_points=False)))
    (where, why), = e.value.problems
    assert where == f"{p}:3: train.objective" and "set tis_cap too" in why


def test_adapter_pushes_refuse_what_cannot_carry_or_serve_adapters():
    """``train.lora.push: adapter`` (the default): SGLang takes adapters through its LoRA routes, not a broadcast
    group; quantised rollouts serve the merged model; outside trajectories do not name the adapter."""
    assert parse("model: {path: /m}\ntrain: {lora: {}}\n").train.lora.push == "adapter"
    for section, why in (("weight_sync: {transport: broadcast}", "not from a broadcast group"),
                         ("rollout: {quantization: fp8}", "quantised weights are the merged model's"),
                         ("rollout: {source: buffer}", "do not name the adapter"),
                         ("rollout: {engines: [{update_weights: false}]}", "never get")):
        found = problems(f"model: {{path: /m}}\ntrain: {{lora: {{}}}}\n{section}\n")
        assert any("with train.lora.push: adapter:" in msg and why in msg for _, msg in found), found
        assert parse(f"model: {{path: /m}}\ntrain: {{lora: {{push: merged}}}}\n{section}\n").train.lora.push == "merged"
    gdn = "train: {lora: {target_modules: [in_proj_qkvz, in_proj_ba, out_proj]}}\n"
    found = problems(f"model: {{path: /m}}\n{gdn}rollout: {{engines: [{{backend: sglang}}]}}\n")
    assert any(w.endswith("rollout.engines[0].backend") and "gated delta nets (in_proj_ba, in_proj_qkvz, out_proj)"
               in msg for w, msg in found), found
    assert parse(f"model: {{path: /m}}\n{gdn}").train.lora.target_modules[0] == "in_proj_qkvz"  # the embedded engine's


def test_multi_lora_names_each_adapter_once_and_refuses_what_one_model_would_serve():
    """``train.lora.adapters``: two or more, each named once; each reads its own prompts (data's path and mix are left
    out), travels as an adapter (not merged) through tensor or disk; eval datasets name adapters it lists; a critic
    would be one for every adapter (preflight)."""
    import json

    two = [{"name": "add", "data": {"path": "a.jsonl"}}, {"name": "sub", "data": {"path": "b.jsonl"}}]

    def doc(lora=None, **sections):
        return json.dumps({"model": {"path": "/m"}, **sections,
                           "train": {"lora": {"adapters": two, **(lora or {})}, **sections.pop("train", {})}})

    assert parse(doc()).train.lora.names == ["add", "sub"]
    assert parse("model: {path: /m}\ntrain: {lora: {}}\n").train.lora.names == [None]
    for adapters, why in (([two[0]], "lists one adapter"), ([two[0], two[0]], "adapter names must be unique"),
                          ([two[0], {**two[1], "name": "a-1"}], "pattern")):
        with pytest.raises(ConfigError, match=why):
            parse(json.dumps({"model": {"path": "/m"}, "train": {"lora": {"adapters": adapters}}}))
    for text, where, why in (
            (doc(data={"path": "d.jsonl"}), "data.path", "each adapter reads its own prompts"),
            (doc(lora={"push": "merged"}), "train.lora.push", "merged weights would be one model"),
            (doc(weight_sync={"transport": "delta"}), "weight_sync.transport", "tensor or disk transport"),
            (doc(eval={"datasets": [{"name": "e", "path": "e.jsonl", "adapter": "mul"}]}), "eval.datasets[0].adapter",
             "'mul' is not one of train.lora.adapters (add, sub)"),
            (doc(train={"objective": {"advantage": "gae"}}), "train.objective.advantage", "one for every adapter")):
        found = problems(text, plugins=build_plugins(entry_points=False))
        assert any(w.endswith(where) and why in msg for w, msg in found), (where, found)
    found = problems("model: {path: /m}\neval: {datasets: [{name: e, path: e.jsonl, adapter: add}]}\n")
    assert any("not one of train.lora.adapters (none listed)" in msg for _, msg in found), found

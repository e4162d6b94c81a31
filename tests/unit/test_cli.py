import json
import textwrap
import types

import typer

from rlx import hookimpl
from rlx_cli import main as cli


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_plugins_json_lists_builtins_with_the_documented_keys(capsys):
    code, out, _ = run(capsys, "plugins", "--json")
    assert code == 0
    rows = json.loads(out)
    builtin = next(r for r in rows if r["name"] == "rlx.builtins.rewards")
    assert set(builtin) == {"name", "distribution", "version", "registers", "error"}
    assert builtin["registers"]["rewards"] == ["exact_match", "digits"] and builtin["error"] is None


def test_plugins_json_is_json_when_a_plugin_fails_to_load(capsys, monkeypatch):
    """A plugin whose component breaks its contract is listed with its error; the others load; exit status 2."""
    from rlx import plugins as plugins_mod

    class NoScore:
        name = "broken"

    bad = types.ModuleType("bad")
    bad.register_rewards = hookimpl(lambda register: register(NoScore))
    real = plugins_mod.build_plugins
    monkeypatch.setattr(plugins_mod, "build_plugins", lambda **kw: real(extra=[("bad", bad)], **kw))
    code, out, _ = run(capsys, "plugins", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 2 and 'is missing the "Reward" protocol member score: score(sample)' in rows["bad"]["error"] and rows["bad"]["registers"] == {}
    assert rows["rlx.builtins.rewards"]["error"] is None and rows["rlx.builtins.rewards"]["registers"]
    code, out, _ = run(capsys, "plugins")
    assert code == 2 and "failed:" in out and "exact_match" in out


def test_plugins_piped_is_a_whole_line_each(capsys):
    code, out, _ = run(capsys, "plugins")  # captured: not a terminal
    line = next(x for x in out.splitlines() if x.startswith("rlx.builtins.rewards "))
    assert code == 0 and line.startswith("rlx.builtins.rewards (rlx ") and "rewards: exact_match, digits" in line


def test_plugins_table_on_a_terminal(capsys, monkeypatch):
    from rich.console import Console

    from rlx_cli import main as cli

    monkeypatch.setattr(cli, "out", Console(force_terminal=True, width=200))
    code, out, _ = run(capsys, "plugins")
    assert code == 0 and "exact_match" in out and "distribution" in out


def test_validate_ok_and_show_prints_defaults(tmp_path, capsys):
    p = write(tmp_path, """
        model: {path: builtin://tiny-qwen3}
        rollout:
          rewards: [exact_match]
    """)
    assert run(capsys, "config", "validate", str(p))[0] == 0
    missing = write(tmp_path, "model: {path: /m}\n", name="missing.yaml")
    code, _, err = run(capsys, "config", "validate", str(missing))  # validate checks the files a config names
    assert code == 2 and "model.path: /m does not exist" in err
    code, out, _ = run(capsys, "config", "show", str(p), "--set", "rollout.sampling.temperature=0.5")
    assert code == 0
    assert "temperature: 0.5" in out and "n_samples_per_prompt: 4" in out and "name: exact_match" in out


def test_three_problems_at_once_exit_2_without_traceback(tmp_path, capsys):
    p = write(tmp_path, """
        run:
          name: x
          sed: 3
        rollout:
          n_prompts: many
    """)
    code, out, err = run(capsys, "config", "validate", str(p))
    assert code == 2
    assert "Traceback" not in err + out
    assert "3 problems" in err
    assert f"{p}:4: run.sed: unknown key (did you mean 'seed'?)" in err
    assert f"{p}:6: rollout.n_prompts: Input should be a valid integer" in err
    assert "model: required, but missing" in err


def test_unknown_reward_and_bad_args_are_reported_with_paths(tmp_path, capsys):
    p = write(tmp_path, """
        model: {path: /m}
        rollout:
          rewards:
            - name: exact_mach
            - name: exact_match
              args: {strp: true}
    """)
    code, _, err = run(capsys, "config", "validate", str(p))
    assert code == 2
    assert f"{p}:5: rollout.rewards[0].name: no reward named 'exact_mach'" in err
    assert f"{p}:7: rollout.rewards[1].args.strp: unknown key" in err


def test_model_kernels_name_installed_ops_and_kernels(tmp_path, capsys):
    """``model.kernels`` is checked against the installed kernel plugins (a choice no model reads is an error);
    rlx-kernel-flashqla, installed with the suite, registers the gdn op."""
    p = write(tmp_path, """
        model:
          path: /m
          kernels: {gdn: flashqlaa, attn: auto}
    """)
    code, _, err = run(capsys, "config", "validate", str(p))
    assert code == 2
    assert f"{p}:4: model.kernels.gdn: unknown gdn kernel 'flashqlaa'; installed: flashqla, fla, torch (or auto)" in err
    assert "model.kernels.attn: no installed kernel runs 'attn'" in err
    p = write(tmp_path, """
        model:
          path: /m
          kernels: {gdn: torch}
    """)
    assert "model.kernels" not in run(capsys, "config", "validate", str(p))[2]


def test_missing_file_is_a_one_line_error(tmp_path, capsys):
    code, _, err = run(capsys, "config", "validate", str(tmp_path / "nope.yaml"))
    assert code == 2 and "cannot read" in err and "Traceback" not in err


def test_register_commands_hook_adds_a_subcommand(monkeypatch, capsys):
    from rlx import plugins as plugins_mod

    def register_commands(app: typer.Typer):
        @app.command("hello")
        def hello():
            print("hello from a plugin")

    mod = types.ModuleType("cmds")
    mod.register_commands = hookimpl(register_commands)
    real = plugins_mod.build_plugins
    monkeypatch.setattr(plugins_mod, "build_plugins", lambda **kw: real(extra=[("cmds", mod)], **kw))
    monkeypatch.setattr(cli, "app", typer.Typer())  # a fresh app, so the command is not added twice
    cli.app.command("plugins")(cli.plugins_cmd)
    code, out, _ = run(capsys, "hello")
    assert code == 0 and "hello from a plugin" in out


def test_validate_reports_every_problem_at_once_each_where_it_was_made(tmp_path, capsys):
    """What `rl train` would refuse, `rl config validate` reports first, all of it, without starting anything: a
    schema error does not hide a component's name, its args (with the keys it takes), the built-in model's name
    or the files; a --set mistake is located at the --set."""
    (tmp_path / "ok.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    p = write(tmp_path, """
        model:
          path: builtin://tiny-qwen4
        data:
          path: nope.jsonl
        rollout:
          rewards:
            - {name: exact_match, args: {strp: true, foo: 1}}
            - digitz
        train:
          num_steps: abc
        eval:
          datasets:
            - {name: h, path: missing.jsonl}
            - {name: g, path: ok.jsonl}
        """)
    code, _, err = run(capsys, "config", "validate", str(p), "--set", "rollout.n_prompts=0", "--set",
                       "eval.datasets.1.path=gone.jsonl")
    lines = [" ".join(x.split()) for x in err.split("\n  ")[1:]]
    assert code == 2 and err.startswith("error: 9 problems in config"), err
    want = [
        "--set rollout.n_prompts=0: rollout.n_prompts: Input should be greater than or equal to 1 (got 0)",
        "c.yaml:11: train.num_steps: Input should be a valid integer",
        "c.yaml:8: rollout.rewards[0].args.strp: unknown key (did you mean 'strip'?)",
        "c.yaml:8: rollout.rewards[0].args.foo: unknown key; known keys: strip, case_sensitive",
        "c.yaml:9: rollout.rewards[1].name: no reward named 'digitz' (did you mean 'digits'?)",
        "c.yaml:3: model.path: unknown built-in model 'builtin://tiny-qwen4'; did you mean 'builtin://tiny-qwen3'?",
        f"c.yaml:5: data.path: {tmp_path}/nope.jsonl does not exist",
        f"c.yaml:14: eval.datasets[0].path: {tmp_path}/missing.jsonl does not exist",
        f"--set eval.datasets.1.path=gone.jsonl: eval.datasets[1].path: {tmp_path}/gone.jsonl does not exist",
    ]
    assert len(lines) == len(want), lines
    for line, w in zip(lines, want, strict=True):
        assert line.startswith(w) or line.startswith(f"{p}:" + w.removeprefix("c.yaml:")), (line, w)


def test_the_summary_says_what_it_measured(tmp_path):
    def rows(n):
        return "".join(json.dumps({"step": i, "reward/mean": i / 10}) + "\n" for i in range(1, n + 1))

    (tmp_path / "metrics.jsonl").write_text(rows(12))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"dataset": "h", "step": 0, "pass@1": 0.15}) + "\n"
                                         + json.dumps({"dataset": "h", "step": 12, "pass@1": 0.5}) + "\n")
    assert cli._summary(tmp_path) == [f"done: 12 steps in {tmp_path}.",
                                      "mean reward: 0.300 over the first 5 steps, 1.000 over the last 5.",
                                      "held-out h: pass@1 0.150 at step 0, 0.500 at step 12."]
    (tmp_path / "metrics.jsonl").write_text(rows(3))  # shorter than two windows, and than eval.interval
    (tmp_path / "eval.jsonl").write_text(json.dumps({"dataset": "h", "step": 0, "pass@1": 0.15}) + "\n")
    assert cli._summary(tmp_path)[1:] == [
        "mean reward: 0.100 at step 1, 0.300 at step 3.",
        "held-out h: pass@1 0.150 at step 0 (evaluated once: the run ended before eval.interval steps)."]

"""The ``rl`` command: parse arguments, call core, turn `RLXError` into one line and an exit code.

Commands stay thin; plugins add their own through the ``register_commands`` hook.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from rlx.errors import Interrupted, RLXError

app = typer.Typer(no_args_is_help=True, add_completion=False, help="rlx: RL post-training for LLMs.")
config_app = typer.Typer(no_args_is_help=True, help="Check and print configs.")
app.add_typer(config_app, name="config")

out = Console()
err = Console(stderr=True)

ConfigArg = Annotated[Path, typer.Argument(help="YAML config file.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a value: --set rollout.sampling.temperature=0.7 (repeatable)."),
]


def _plugins():
    from rlx.plugins import process_plugins

    return process_plugins()


def _load(file: Path, sets: list[str] | None, files: bool = False, download: bool = False):
    """The config at `file` with `sets`, checked against the installed plugins and, with `files`, the files it
    names (`rlx.preflight.config_checks`; `download`: a model named by Hub id is downloaded)."""
    from rlx.config import load_config
    from rlx.preflight import config_checks, download_models

    cfg = load_config(file, sets or [], checks=config_checks(_plugins(), files=files))
    if download:
        download_models(cfg, file, files)
    return cfg


@app.command("plugins")
def plugins_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
) -> None:
    """List the plugins and what each registers; one that fails to load is listed with its error (exit status 2)."""
    from rlx.plugins import build_plugins

    infos = build_plugins(keep_going=True).infos
    failed = [i for i in infos if i.error]
    if as_json:
        print(json.dumps([i.to_dict() for i in infos], indent=2))
    elif not out.is_terminal:  # piped: whole lines, never cut to a table's 80 columns
        for i in infos:
            regs = "; ".join(f"{k}: {', '.join(v)}" for k, v in i.registers.items()) or "(hooks only)"
            print(f"{i.name} ({i.distribution} {i.version}): {f'failed: {i.error}' if i.error else regs}")
    else:
        table = Table(title="rlx plugins")
        for col in ("name", "distribution", "version", "registers"):
            table.add_column(col)
        for i in infos:
            regs = "\n".join(f"{k}: {', '.join(v)}" for k, v in i.registers.items()) or "(hooks only)"
            table.add_row(i.name, i.distribution, i.version, f"[red]failed: {i.error}[/red]" if i.error else regs)
        out.print(table)
    if failed:
        raise typer.Exit(2)


@config_app.command("validate")
def config_validate(file: ConfigArg, set_: SetOpt = None) -> None:
    """Check a config: types, unknown keys, required fields, component names and their args."""

    _load(file, set_, files=True)
    out.print(f"[green]ok[/green] {file}")


@config_app.command("show")
def config_show(file: ConfigArg, set_: SetOpt = None) -> None:
    """Print the resolved config, defaults included, as YAML."""

    cfg = _load(file, set_)
    print(cfg.to_yaml(), end="")


@app.command("rollout")
def rollout_cmd(
    file: ConfigArg,
    set_: SetOpt = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="JSONL file for the groups.")] = None,
) -> None:
    """Generate and score rollouts with no training; write the groups as JSONL."""
    import asyncio

    from rlx.rollout.session import rollout_only

    cfg = _load(file, set_, files=True, download=True)

    def progress(step, batch):
        m = batch.metrics
        out.print(f"step {step}/{cfg.rollout.num_steps}: {len(batch.groups)} groups, "
                  f"reward/mean {m['reward/mean']:.3f}, response_len/mean {m['response_len/mean']:.1f}, "
                  f"{m['time/rollout_s']:.2f}s")

    path = asyncio.run(rollout_only(cfg, _plugins(), output, progress))
    out.print(f"wrote {path}")


@app.command("serve")
def serve_cmd(
    file: ConfigArg,
    set_: SetOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to bind (0: any free port).")] = 8000,
    api_key: Annotated[str | None, typer.Option("--api-key", help="Bearer key clients must send "
                                                "(default: a random one, printed).")] = None,
    parser: Annotated[str, typer.Option("--parser", help="Tool-call parser (auto: by model family).")] = "auto",
    max_output_tokens: Annotated[int | None, typer.Option(
        "--max-output-tokens", min=1, help="The most one call generates; a larger or unset max_tokens gets this many "
        "(default: as asked, unset meaning up to the context).")] = None,
) -> None:
    """Serve the policy over OpenAI- and Anthropic-compatible APIs: engines, router and adapter."""
    import asyncio

    from rlx.agent.server import AgentAdapter, serve_forever
    from rlx.rollout.session import RolloutSession

    cfg = _load(file, set_, download=True)

    async def main() -> None:
        import signal

        me = asyncio.current_task()
        with contextlib.suppress(RuntimeError, ValueError):  # SIGTERM stops it as Ctrl-C does (not in a thread)
            if me is not None:
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, me.cancel)
        async with RolloutSession(cfg, _plugins(), with_data=False) as session:
            adapter = AgentAdapter(session.ctx, model_name=cfg.run.name, api_key=api_key, parser=parser,
                                   max_output_tokens=max_output_tokens)

            def ready(url: str) -> None:
                out.print(f"serving {cfg.model.path} at {url}/v1 (OpenAI) and {url} (Anthropic)", soft_wrap=True)
                out.print(f"base_url {url}/v1 api_key {adapter.api_key}", soft_wrap=True)

            await serve_forever(adapter, host, port, ready)

    try:
        asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C, or SIGTERM
        out.print("stopped")


@app.command("train")
def train_cmd(
    file: ConfigArg,
    set_: SetOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the newest checkpoint.")] = False,
    save_hf: Annotated[Path | None, typer.Option("--save-hf", help="Export an HF checkpoint here at the end.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", help="Show Ray's own output here too.")] = False,
) -> None:
    """Train: rollout, train, push weights, log and checkpoint, every step."""
    import asyncio

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rlx.orchestrate.loop import train

    cfg = _load(file, set_, files=True, download=True)
    err.print(f"run: {cfg.run.output_dir} (run.output_dir, relative to the config's folder); logs (Ray, engines, "
              f"trainers) in its logs/", highlight=False, soft_wrap=True)
    with Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[info]}"), console=err) as bar:
        task = bar.add_task("train", total=cfg.train.num_steps, info="starting engines and trainer")

        def progress(step, m):
            loss = f"{m['loss']:+.4f}" if m.get("loss") is not None else "-"  # None: a critic warm-up step
            bar.update(task, completed=step, info=f"reward {m['reward/mean']:.3f}  loss {loss}  "
                                                  f"lp-diff {m.get('train_rollout_logprob_diff', 0.0):.2e}  "
                                                  f"{m['time/step_s']:.2f}s/step")

        out_dir = asyncio.run(train(cfg, _plugins(), resume=resume, save_hf=save_hf, progress=progress,
                                    verbose=verbose))
    for line in _summary(out_dir):
        out.print(line, soft_wrap=True, highlight=False)
    if save_hf:
        out.print(f"HF checkpoint: {save_hf}", soft_wrap=True, highlight=False)


def _summary(out_dir: Path) -> list[str]:
    """What a run did, a sentence a line: its steps, its mean reward then and now, each held-out pass@1 then and
    now (from metrics.jsonl and eval.jsonl)."""
    from rlx.orchestrate.metrics import read, read_eval

    rows = read(out_dir)
    lines = [f"done: {len(rows)} steps in {out_dir}."]
    if len(rows) >= 10:
        first, last = rows[:5], rows[-5:]
        mean = lambda rs: sum(r["reward/mean"] for r in rs) / len(rs)  # noqa: E731
        lines.append(f"mean reward: {mean(first):.3f} over the first {len(first)} steps, {mean(last):.3f} over the "
                     f"last {len(last)}.")
    elif rows:  # too few steps for two windows of five that do not overlap
        a, b = rows[0], rows[-1]
        lines.append(f"mean reward: {a['reward/mean']:.3f} at step {a['step']}"
                     + (f", {b['reward/mean']:.3f} at step {b['step']}." if b is not a else "."))
    evals: dict[str, list[dict]] = {}
    for r in read_eval(out_dir):
        evals.setdefault(r["dataset"], []).append(r)
    for name, rs in evals.items():
        a, b = rs[0], rs[-1]
        then = f"held-out {name}: pass@1 {a['pass@1']:.3f} at step {a['step']}"
        lines.append(then + (f", {b['pass@1']:.3f} at step {b['step']}." if b is not a else
                             " (evaluated once: the run ended before eval.interval steps)."))
    return lines


@app.command("eval")
def eval_cmd(
    file: ConfigArg,
    set_: SetOpt = None,
    checkpoint: Annotated[Path | None, typer.Option(
        "--checkpoint", help="An rlx checkpoint (<output_dir>/checkpoints/step_N, or the checkpoints folder for "
                             "the newest) or an HF model folder; default: the config's model.")] = None,
) -> None:
    """Evaluate a policy on the config's eval datasets: a table here, a row per dataset in eval.jsonl."""
    import asyncio

    from rlx.orchestrate.evals import evaluate
    from rlx.rollout.evaluator import table

    cfg = _load(file, set_, files=True, download=True)
    err.print(f"logs (engines): {Path(cfg.run.output_dir) / 'logs'}", highlight=False, soft_wrap=True)
    metrics, path = asyncio.run(evaluate(cfg, _plugins(), checkpoint))
    out.print(table(metrics, [d.name for d in cfg.eval.datasets]), highlight=False, soft_wrap=True)
    out.print(f"wrote {path}", highlight=False, soft_wrap=True)


@app.command("plot")
def plot_cmd(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run output folders (holding metrics.jsonl).")],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="PNG path.")] = None,
) -> None:
    """Plot reward and timing curves of one or more runs into a PNG."""
    from rlx.orchestrate.metrics import plot

    path = plot(run_dirs, output or run_dirs[0] / "curves.png")
    out.print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    from rlx.plugins import reset_process_plugins

    reset_process_plugins()  # an invocation sees the plugins installed now (tests call main() again)
    try:
        try:
            plugins = _plugins()
            plugins.add_commands(app)
        except RLXError:
            pass  # reported below by whichever command builds the plugins again
        else:
            args = sys.argv[1:] if argv is None else argv
            for info in plugins.failed if args[:1] != ["plugins"] else []:  # `rl plugins` shows them in its table
                err.print(Text(f"warning: plugin {info.name!r} ({info.distribution}) failed to load and is left out: "
                               f"{info.error}", style="yellow"), soft_wrap=True)
        code = app(args=argv, standalone_mode=False)  # typer.Exit(n) in a command: click returns n
    except Interrupted as e:  # a signal stopped a run: what was saved, not an error
        err.print(Text(f"rlx: {e}"), soft_wrap=True)
        return e.exit_code
    except RLXError as e:
        err.print(Text("error: ", style="bold red") + Text(str(e)), soft_wrap=True)
        return e.exit_code
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except typer.Exit as e:
        return e.exit_code
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except Exception as e:  # click's usage errors
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            return e.exit_code
        if isinstance(e, click.exceptions.Abort):  # click's name for a KeyboardInterrupt
            err.print("interrupted")
            return 130
        raise
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Real coding-agent harnesses as rlx agents: Claude Code and Codex, unmodified, each run in a sandbox against
rlx's adapter, rewarded by the task's own tests.

``rollout.generator: {name: agent, args: {function: claude_code}}`` (or ``codex``) runs, for every sample:

1. a sandbox (``rlx-agent-sandbox``): the task's files in a folder of their own (read-write, ``/task``), the
   system's programs, this Python and the harness's install folder read-only, nothing else; the network reaches
   only the adapter;
2. the harness's CLI there, non-interactively (``claude -p`` / ``codex exec``) with its own prompts and tools,
   pointed at the adapter (``ANTHROPIC_BASE_URL`` / a ``model_providers`` entry on the Responses API) with the
   sample's key, so every model call it makes lands in the sample's session, token in, token out;
3. the task's test command in the same folder afterwards, with the task's test files written back as they were
   (a harness that edits the test instead of the code gains nothing): the reward is 1.0 if it passes, else 0.0.
   The code under test runs in the test's own process, so a policy that learns to end that process early with
   status 0 would pass: graders that must resist that run the tests in a harness of their own.

A task is a dataset row whose metadata holds ``files`` (path -> content: a small repository with a failing
test), ``test`` (a shell command run in its folder, e.g. ``python test_calc.py``) and optionally
``test_files`` (which of ``files`` are the tests; default: ``test_*.py``, ``*_test.py`` and anything under a
``tests/`` folder); the row's prompt is what the harness is asked. The CLIs are installed once with ``rl-coding-harness install`` (npm, into
``~/.cache/rlx/harness`` or ``$RLX_HARNESS_DIR``).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from rlx import hookimpl
from rlx.errors import RLXError
from rlx.hookspecs import RegisterAgents

log = logging.getLogger(__name__)

__all__ = ["ClaudeCode", "ClaudeCodeConfig", "Codex", "HarnessConfig", "harness_dir", "install", "main"]

PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}


def harness_dir() -> Path:
    """Where the harness CLIs are installed (``$RLX_HARNESS_DIR``, default ``~/.cache/rlx/harness``)."""
    return Path(os.environ.get("RLX_HARNESS_DIR", Path.home() / ".cache" / "rlx" / "harness")).expanduser()


def cli_path(folder: Path, cli: str) -> Path | None:
    """The installed CLI `cli` ("claude" or "codex") under `folder`, or None."""
    p = folder / "node_modules" / ".bin" / cli
    return p if p.exists() else None


def install(folder: Path | None = None, clis: tuple[str, ...] = ("claude", "codex")) -> Path:
    """npm-install the harness CLIs into `folder` (their own folder: nothing global); returns it."""
    folder = folder or harness_dir()
    npm = shutil.which("npm")
    if npm is None:
        raise RLXError("installing the harnesses needs npm (Node.js 18 or newer): e.g. apt install nodejs npm")
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([npm, "install", "--prefix", str(folder), "--no-audit", "--no-fund",
                    *(PACKAGES[c] for c in clis)], check=True)
    return folder


def test_files(meta: dict[str, Any]) -> list[str]:
    """The task's test files: ``metadata.test_files``, or the files named like tests."""
    if "test_files" in meta:
        return list(meta["test_files"])
    return [name for name in meta["files"] if fnmatch.fnmatch(os.path.basename(name), "test_*.py")
            or fnmatch.fnmatch(os.path.basename(name), "*_test.py") or "tests" in Path(name).parts[:-1]]


class HarnessConfig(BaseModel):
    """``rollout.generator.args.agent_args`` of the ``codex`` agent (and the base of ``claude_code``'s)."""

    model_config = ConfigDict(extra="forbid")

    harness_dir: str | None = None  # where `rl-coding-harness install` put the CLIs (None: harness_dir())
    time_limit_s: float = Field(300, gt=0)  # the harness's whole run (Codex has no turn limit of its own)
    test_time_limit_s: float = Field(60, gt=0)  # the task's tests
    memory_mb: int = Field(4096, ge=256)  # address space of each process (Node reserves a lot of it)
    isolate_files: bool = True  # False only where no mount namespace can be made (the harness then sees every file)
    # more environment for the CLI, e.g. Claude Code's CLAUDE_CODE_AUTO_COMPACT_WINDOW; not what rlx sets itself
    env: dict[str, str] = Field(default_factory=dict)
    # more CLI arguments, put before the prompt: e.g. Codex's ["-c", "model_auto_compact_token_limit=60000"]
    args: list[str] = Field(default_factory=list)


class ClaudeCodeConfig(HarnessConfig):
    """``rollout.generator.args.agent_args`` of the ``claude_code`` agent."""

    max_turns: int = Field(4, ge=1)  # model calls Claude Code may make for one task (its --max-turns)


class Harness(ABC):
    """What both harnesses share: the sandbox, the task's files and tests, the reward. A harness says how its
    CLI is started (`command`)."""

    name = ""
    cli = ""
    Config = HarnessConfig

    def __init__(self, config: HarnessConfig | None = None):
        self.config = config or HarnessConfig()
        self.folder = Path(self.config.harness_dir).expanduser() if self.config.harness_dir else harness_dir()
        self.exe = cli_path(self.folder, self.cli)
        if self.exe is None:
            raise RLXError(f"agent {self.name!r}: the {self.cli} CLI is not installed in {self.folder}: run "
                           f"`rl-coding-harness install` (npm install {PACKAGES[self.cli]} there)")
        ours = {"HOME", *self.command("", "http://127.0.0.1:1", "key")[1]}
        if clash := sorted(set(self.config.env) & ours):
            raise RLXError(f"agent {self.name!r}: agent_args.env sets {clash}, which rlx sets for the {self.cli} CLI "
                           f"itself")

    @abstractmethod
    def command(self, prompt: str, base_url: str, api_key: str) -> tuple[list[str], dict[str, str]]:
        """The CLI's argv and the environment it needs, to answer `prompt` through the adapter at `base_url`."""

    async def run(self, base_url: str, api_key: str, task: dict[str, Any]) -> float:
        """The agent: run the harness on the task, then its tests; the reward is 1.0 if they pass, else 0.0."""
        ran, tests = await self.attempt(base_url, api_key, task)
        if not ran.ok:
            log.warning("%s on task %s: %s; stderr: %s", self.name, task.get("sample_id"),
                        "timed out" if ran.timed_out else f"exit {ran.returncode}", ran.stderr[-400:])
        return 1.0 if tests.ok else 0.0

    async def attempt(self, base_url: str, api_key: str, task: dict[str, Any]) -> tuple[Any, Any]:
        """The harness's run and the tests' run on `task` (`rlx_agent_sandbox.Result` each)."""
        from rlx_agent_sandbox import Sandbox

        meta = task.get("metadata") or {}
        files, test = meta.get("files"), meta.get("test")
        if not isinstance(files, dict) or not files or not isinstance(test, str) or not test.strip():
            raise RLXError(f"agent {self.name!r}: task {task.get('sample_id')} needs metadata.files (path -> "
                           f"content) and metadata.test (a shell command), got keys {sorted(meta)}")
        protected = test_files(meta)
        if unknown := [name for name in protected if name not in files]:
            raise RLXError(f"agent {self.name!r}: task {task.get('sample_id')}: metadata.test_files names "
                           f"{unknown}, which are not in metadata.files")
        url = urlsplit(base_url)
        if url.hostname is None or url.port is None:
            raise RLXError(f"agent {self.name!r}: the adapter's address {base_url!r} has no host and port")
        c = self.config
        async with Sandbox(time_limit_s=c.time_limit_s, memory_mb=c.memory_mb, isolate_files=c.isolate_files,
                           toolchain=(str(self.folder),), reach=((url.hostname, url.port),),
                           max_processes=512) as box:
            for name, content in files.items():
                box.write(name, content)
            argv, env = self.command(task["prompt"], base_url, api_key)
            env = {"HOME": "/tmp/home" if c.isolate_files else box.workdir, **env}
            ran = await box.run(argv, env={**c.env, **env})  # rlx's own keys win (a clash is refused at init)
            for name in protected:  # the tests as the task wrote them, whatever the harness did to them
                box.path(name).unlink(missing_ok=True)  # a link the harness put there is replaced, not followed
                box.write(name, files[name])
            tests = await box.run(["sh", "-c", test], timeout_s=c.test_time_limit_s)
        return ran, tests


class ClaudeCode(Harness):
    """Claude Code (``@anthropic-ai/claude-code``) through the Anthropic Messages adapter."""

    name = "claude_code"
    cli = "claude"
    Config = ClaudeCodeConfig
    config: ClaudeCodeConfig

    def __init__(self, config: ClaudeCodeConfig | None = None):
        super().__init__(config or ClaudeCodeConfig())

    def command(self, prompt: str, base_url: str, api_key: str) -> tuple[list[str], dict[str, str]]:
        argv = [str(self.exe), "-p", "--max-turns", str(self.config.max_turns), "--output-format", "json",
                "--dangerously-skip-permissions",  # the sandbox is the permission boundary
                *self.config.args, "--", prompt]  # a prompt that starts with "-" is still the prompt
        env = {"ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": api_key, "IS_SANDBOX": "1",
               "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        return argv, env


class Codex(Harness):
    """Codex CLI (``@openai/codex``) through the OpenAI Responses adapter, as a custom model provider."""

    name = "codex"
    cli = "codex"

    def command(self, prompt: str, base_url: str, api_key: str) -> tuple[list[str], dict[str, str]]:
        url = json.dumps(base_url.rstrip("/") + "/v1")  # a TOML basic string
        provider = f'{{name="rlx", base_url={url}, env_key="RLX_API_KEY", wire_api="responses"}}'
        argv = [str(self.exe), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                "-c", "model=policy", "-c", "model_provider=rlx", "-c", f"model_providers.rlx={provider}",
                *self.config.args, "--", prompt]
        return argv, {"RLX_API_KEY": api_key}


@hookimpl
def register_agents(register: RegisterAgents) -> None:
    register(ClaudeCode)
    register(Codex)


def main(argv: list[str] | None = None) -> int:
    """``rl-coding-harness install [--dir DIR] [claude] [codex]``: install the CLIs; ``rl-coding-harness where``:
    print where they are."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("install", "where"):
        print(main.__doc__)
        return 2
    folder = harness_dir()
    if "--dir" in args:
        i = args.index("--dir")
        if i + 1 >= len(args):
            print("--dir needs a folder")
            return 2
        folder = Path(args[i + 1]).expanduser()
        del args[i:i + 2]
    if args[0] == "where":
        for cli in PACKAGES:
            print(f"{cli}: {cli_path(folder, cli) or 'not installed'}")
        return 0
    clis = tuple(a for a in args[1:] if a in PACKAGES) or tuple(PACKAGES)
    install(folder, clis)
    print(f"installed {', '.join(clis)} in {folder} ({' '.join(shlex.quote(str(cli_path(folder, c))) for c in clis)})")
    return 0

"""rlx transport plugin: lossless delta weight sync through shared storage, for engines that live elsewhere.

``weight_sync.transport: delta`` publishes each push as a full checkpoint or a compressed lossless delta of the
bytes the engines serve (`rlx_transport_delta.transport`); a weights agent beside each engine pulls,
applies, checks and reloads it through the engine's stock ``/update_weights_from_disk``
(`rlx_transport_delta.agent`, ``rl weights-agent``). No engine patches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rlx import hookimpl
from rlx.hookspecs import RegisterTransports


@hookimpl
def register_transports(register: RegisterTransports) -> None:
    from rlx_transport_delta.transport import DeltaTransport

    register(DeltaTransport)


@hookimpl
def register_commands(app):
    @app.command("weights-agent")
    def weights_agent(
        source: Annotated[Path, typer.Option(help="the shared store the trainer publishes versions to")],
        local: Annotated[Path, typer.Option(help="a host-local folder for this engine's checkpoint")],
        engine: Annotated[str, typer.Option(help="the engine's base URL")],
        poll_s: Annotated[float, typer.Option(help="seconds between looks at the store")] = 0.5,
        once: Annotated[bool, typer.Option(help="update the engine once and exit (1 on failure)")] = False,
    ) -> None:
        """Keep an engine's weights at the newest version the delta transport published (beside the engine)."""
        from rlx_transport_delta.agent import main

        args = ["--source", str(source), "--local", str(local), "--engine", engine, "--poll-s", str(poll_s)]
        raise typer.Exit(main(args + (["--once"] if once else [])))

"""How the embedded engine answers what it refuses, in SGLang 0.5.23's shapes."""

from __future__ import annotations

from typing import Any

from aiohttp import web


class BadRequest(Exception):
    """A request the engine refuses: 400 with ``{"error": {"message": ...}}``, as SGLang words most."""


class ContractError(BadRequest):
    """A request SGLang's API schema refuses; SGLang 0.5.23 answers these with ``{"error": "<text>"}``."""


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def result(success: bool, message: str, **extra: Any) -> web.Response:
    """SGLang's answer to a weight or memory call: ``{"success", "message"}`` with 200, or 400 and success false."""
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)

"""The emulator's control API: JSON lines over a Unix socket in the stack's state folder.

A Unix socket rather than a TCP port: only the owner of the state folder can
reach it (the socket is created mode 0600), so no token is needed and nothing
listens on the network. One request per line, one answer per line::

    {"op": "status"}                      -> {"ok": true, "links": [...]}
    {"op": "cut", "link": "central-eu-west"}
    {"op": "heal", "link": "central-eu-west"}
    {"op": "set", "link": "...", "delay_ms": 100, "jitter_ms": 5, "bandwidth_mbit": 50}

Errors answer ``{"ok": false, "error": "..."}``; the emulator keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edgefeed.wan.exceptions import (
    LinkSettingError,
    UnknownLinkError,
    WanControlError,
    WanError,
)
from edgefeed.wan.proxy import Link

__all__ = ["ControlServer", "WanControl"]

_MAX_LINE = 64 * 1024
_KINDS: dict[type[WanError], str] = {
    UnknownLinkError: "unknown-link",
    LinkSettingError: "bad-value",
}
_ERRORS: dict[str, type[WanError]] = {kind: cls for cls, kind in _KINDS.items()}


def _number(request: Mapping[str, Any], key: str) -> float | None:
    value = request.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WanError(f"{key} must be a number, got {value!r}")
    return float(value)


class ControlServer:
    """Serves the control API for a set of running links."""

    def __init__(self, links: Mapping[str, Link], path: Path) -> None:
        self.links, self.path = dict(links), path
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, str(self.path))
        finally:
            os.umask(old)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _link(self, request: Mapping[str, Any]) -> Link:
        name = request.get("link")
        link = self.links.get(str(name))
        if link is None:
            raise UnknownLinkError(
                f"no link {name!r}; links: {', '.join(sorted(self.links)) or '(none)'}"
            )
        return link

    def handle(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """One request's answer (errors become ``ok: false`` answers)."""
        try:
            op = request.get("op")
            if op == "status":
                return {"ok": True, "links": [link.status() for link in self.links.values()]}
            if op == "cut":
                self._link(request).cut()
            elif op == "heal":
                self._link(request).heal()
            elif op == "set":
                self._link(request).set(
                    delay_ms=_number(request, "delay_ms"),
                    jitter_ms=_number(request, "jitter_ms"),
                    bandwidth_mbit=_number(request, "bandwidth_mbit"),
                )
            else:
                raise WanError(f"unknown op {op!r}; ops: status, cut, heal, set")
            return {"ok": True, "link": self._link(request).status()}
        except WanError as exc:
            return {"ok": False, "error": str(exc), "kind": _KINDS.get(type(exc), "error")}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    request = json.loads(line[:_MAX_LINE])
                    if not isinstance(request, dict):
                        raise ValueError("not an object")
                    answer = self.handle(request)
                except ValueError as exc:
                    answer = {"ok": False, "error": f"request is not a JSON object: {exc}"}
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        except (OSError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()


class WanControl:
    """A synchronous client of the control API (for the CLI and the tests).

    Args:
        path: The emulator's control socket (``<state dir>/run/wan.sock``).
    """

    def __init__(self, path: Path, timeout_s: float = 5.0) -> None:
        self.path, self.timeout_s = Path(path), timeout_s

    def request(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Send one request.

        Raises:
            WanControlError: the emulator does not answer.
            UnknownLinkError: the request names no running link.
            LinkSettingError: a value is out of range.
            WanError: the emulator refused the request; the message says why.
        """
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout_s)
                sock.connect(str(self.path))
                sock.sendall(json.dumps(dict(request)).encode() + b"\n")
                data = b""
                while not data.endswith(b"\n"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    data += chunk
        except OSError as exc:
            raise WanControlError(
                f"the WAN emulator does not answer on {self.path} ({exc.strerror or exc}); "
                "start the sites with `edgefeed dev up` (settings with a sites: section)"
            ) from None
        answer: dict[str, Any] = json.loads(data or b"{}")
        if not answer.get("ok"):
            error = str(answer.get("error", "no answer"))
            raise _ERRORS.get(str(answer.get("kind")), WanError)(error)
        return answer

    def status(self) -> list[dict[str, Any]]:
        links: list[dict[str, Any]] = self.request({"op": "status"})["links"]
        return links

    def cut(self, link: str) -> dict[str, Any]:
        result: dict[str, Any] = self.request({"op": "cut", "link": link})["link"]
        return result

    def heal(self, link: str) -> dict[str, Any]:
        result: dict[str, Any] = self.request({"op": "heal", "link": link})["link"]
        return result

    def set(
        self,
        link: str,
        *,
        delay_ms: float | None = None,
        jitter_ms: float | None = None,
        bandwidth_mbit: float | None = None,
    ) -> dict[str, Any]:
        request = {
            "op": "set",
            "link": link,
            "delay_ms": delay_ms,
            "jitter_ms": jitter_ms,
            "bandwidth_mbit": bandwidth_mbit,
        }
        result: dict[str, Any] = self.request(request)["link"]
        return result

"""--admin-port: the admin API (and the LoRA load/unload endpoints) answers only on its own port, and that
port answers nothing else.

One server listens on both ports (http/server.py); the local port of the connection (`scope["server"]`)
tells which listener a request came in on, so a NetworkPolicy or firewall can expose the API port and
keep the admin port internal.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from conduit_gateway.errors import OpenAIError
from conduit_gateway.http.middleware import HttpMiddleware, send_error

# Admin requests outside /admin: loading and unloading LoRA adapters (http/lora_routes.py).
ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def is_admin_path(path: str) -> bool:
    return path == "/admin" or path.startswith("/admin/") or path in ADMIN_PATHS


class AdminPortMiddleware(HttpMiddleware):
    """404 for /admin on any port but `admin_port`, and for anything else on `admin_port`."""

    def __init__(self, app: ASGIApp, admin_port: int) -> None:
        super().__init__(app)
        self.admin_port = admin_port

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        on_admin_port = server is not None and server[1] == self.admin_port
        if on_admin_port != is_admin_path(scope["path"]):
            message = f"Invalid URL ({scope['method']} {scope['path']})"
            await send_error(send, OpenAIError(404, message, code="not_found"))
            return
        await self.app(scope, receive, send)

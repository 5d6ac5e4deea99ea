"""Who may talk to the gateway: API keys, the bind policy, the DNS-rebinding guard.

See docs/security.md for how an operator puts these together.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
import socket
import time
from pathlib import Path

from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError, error_payload
from gateway.settings import GatewaySettings

log = logging.getLogger("mlxd.gateway.security")

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "[::1]", "::1"}
# Names under these no one can register, so no page can rebind them: Docker
# Desktop's containers reach the Mac as host.docker.internal.
RESERVED_SUFFIXES = (".localhost", ".internal")
# Origins only software on the client's own machine has, which Ollama's apps count on being let in
# (as Ollama lets them in): desktop apps' pages (Electron's app:// and file://, Tauri's, VS Code's
# webviews, whose name is random) and pages served on loopback. No web page elsewhere can take one.
LOCAL_APP_ORIGINS = r"(app|file|tauri|vscode-webview|vscode-file)://[^/]*|https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


class Cors:
    """CORS: the origins --cors-origin names, everywhere; local apps' pages
    (LOCAL_APP_ORIGINS), on the APIs alone: never the operator's /admin, nor
    /metrics, /health or /ready."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings) -> None:
        allowed: dict = dict(allow_origins=settings.cors_origin, allow_methods=["GET", "POST", "DELETE"],
                             # Any header: the SDKs in a browser send their own (anthropic-version,
                             # x-stainless-*), and keys guard the API.
                             allow_headers=["*"])
        self.everywhere = CORSMiddleware(app, **allowed)
        self.apis = CORSMiddleware(app, allow_origin_regex=LOCAL_APP_ORIGINS, **allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        api = path == "/" or path.startswith(("/v1/", "/api/"))  # / is Ollama's "is it running"
        await (self.apis if api else self.everywhere)(scope, receive, send)


def machine_names() -> set[str]:
    """This machine's own names, as clients on the network reach it: its host
    name, with and without `.local` (a Mac's Bonjour name)."""
    name = socket.gethostname().lower()
    short = name.removesuffix(".local")
    return {name, short, short + ".local"}


def ip_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a host names literally (IPv6 in brackets or not); None for a name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    address = ip_address(host)
    return host == "localhost" or address is not None and address.is_loopback


def keys_required(settings: GatewaySettings) -> bool:
    """Listening beyond loopback needs API keys, unless the operator says otherwise."""
    return not is_loopback(settings.host) and not settings.insecure_no_auth


def check_bind_policy(settings: GatewaySettings, has_keys: bool) -> None:
    """Refuse to listen beyond loopback with no API key, unless told to."""
    if is_loopback(settings.host) or has_keys:
        return
    if keys_required(settings):
        raise SystemExit(
            f"mlxd: refusing to listen on {settings.host} without an API key: anyone who can reach "
            "this address could use the model. Add one with --api-key KEY (or MLXD_API_KEYS, or "
            "--api-key-file FILE), or, on a network you trust completely, pass --insecure-no-auth."
        )
    log.warning(
        "!!! listening on %s with NO API KEY (--insecure-no-auth): anyone who can reach this "
        "address can use the model !!!", settings.host,
    )


MIN_KEY_LENGTH = 16  # shorter keys are warned of: 8 hex characters are 4 billion guesses


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """The accepted API keys: from --api-key/MLXD_API_KEYS and --api-key-file (re-read on SIGHUP).

    A key file that holds none (an emptied file, one of comments only) is
    refused, at start (ValueError) and on a reload, where the keys loaded
    before stay: keys once on never turn off with a file saved half-written,
    nor does a server told to use keys start without any, beyond loopback or
    on it (where a proxy may bring the LAN). Serving without keys takes a
    restart without --api-key-file.
    """

    def __init__(self, keys: list[str], key_file: str | None, kind: str = "API keys") -> None:
        self.kind = kind
        self._static = [k for k in keys if k]
        self._file = Path(key_file) if key_file else None
        self._digests: list[bytes] = []
        self.reload()

    def reload(self) -> None:
        """Re-read the key file, a key a line; `#` begins a comment, on a line
        of its own or after a key. Raises OSError if it cannot be read and
        ValueError if it holds no key; either way the keys loaded before stay."""
        keys = list(self._static)
        if self._file is not None:
            keys += [key for line in self._file.read_text().splitlines() if (key := line.partition("#")[0].strip())]
            if not keys:
                raise ValueError(f"{self._file} holds no key")
            if self._file.stat().st_mode & 0o077:
                log.warning("%s may be read by other users of this machine, and its keys with it: make it this "
                            "user's alone (chmod 600 %s)", self._file, self._file)
        self._digests = [_digest(k) for k in keys]
        if keys or self._file is not None:
            log.info("%d %s loaded", len(self._digests), self.kind)
        if short := sum(len(k) < MIN_KEY_LENGTH for k in keys):
            log.warning("%d of the %s are shorter than %d characters: a client could guess them, a request a "
                        "guess (make keys with `openssl rand -hex 32`)", short, self.kind, MIN_KEY_LENGTH)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def identify(self, key: str | None) -> str | None:
        """A stable, non-secret id of an accepted key; None if it is not one.

        Compares the key's digest with every accepted one, in constant time.
        """
        if not key:
            return None
        candidate = _digest(key)
        found = b""
        for digest in self._digests:
            if hmac.compare_digest(digest, candidate):
                found = digest
        return found.hex()[:12] if found else None


def presented_key(headers: dict[bytes, bytes]) -> str | None:
    if value := headers.get(b"x-api-key"):
        return value.decode("latin-1").strip()
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class Guard:
    """ASGI middleware: the DNS-rebinding guard and API-key checks.

    With keys, /v1/* needs an API key, /metrics an API key or a metrics
    key, and /admin/* an admin key (--admin-key), or without admin keys an
    API key. Sets scope["state"]["client_id"]: the key's id, or (without keys) the
    client's address, for per-client limits; ["key_id"]: the key's id or None;
    and ["authenticated"].
    """

    def __init__(self, app: ASGIApp, settings: GatewaySettings, keys: KeyRing, keep_alive_s: float) -> None:
        """keep_alive_s: the server's own --keep-alive, which with admin keys no API key's request outlasts."""
        self.app = app
        self.keys = keys
        self.metrics_keys = KeyRing(settings.metrics_key, None, kind="metrics keys")
        self.admin_keys = KeyRing(settings.admin_key, None, kind="admin keys")
        # Unloading and pinning models is the admin keys' where there are any (on
        # /admin/*); a request's keep_alive could unload its model (0) or keep it for good.
        self.keep_alive_limit_s = keep_alive_s if self.admin_keys.enabled else None
        self.loopback = is_loopback(settings.host)
        # Beyond loopback (--insecure-no-auth) clients name this machine by an address or its own name.
        self.allowed_hosts = LOOPBACK_NAMES | {h.lower() for h in settings.allowed_host} | (
            set() if self.loopback else machine_names())
        self.any_origin = "*" in settings.cors_origin
        self.origins = {o.encode() for o in settings.cors_origin}
        self.local_app_origin = re.compile(LOCAL_APP_ORIGINS.encode())
        self.refusals = RefusalLog()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrived"] = time.monotonic()
        headers = dict(scope["headers"])
        if not self.keys.enabled and not self._host_allowed(headers.get(b"host", b"")):
            # A web page on another name that resolves to this machine (127.0.0.1, or its
            # address on the network) must not reach a server without keys: under its own
            # name, its requests would pass for the same origin's.
            return await _reject(scope, send, 403, "this Host is not allowed; add it with --allowed-host",
                                 "host_not_allowed")
        path = scope["path"]
        if scope["method"] not in ("GET", "HEAD", "OPTIONS") and cross_site(headers) and (
                path.startswith("/admin/") or not self.keys.enabled and not self._origin_allowed(headers)):
            # A page elsewhere must not act through a browser on this network (a
            # form posts without preflight, and without keys no key stops it):
            # generate, or load and unload models through Ollama's keep_alive.
            return await _reject(scope, send, 403, "an action must come from this server's own page, a page of "
                                 "an origin --cors-origin allows, or a client that is not a browser",
                                 "cross_site_request")
        presented = presented_key(headers)
        key_id = self.keys.identify(presented) if self.keys.enabled else None
        refusal = None
        if path == "/metrics" and (self.keys.enabled or self.metrics_keys.enabled):
            if key_id is None and self.metrics_keys.identify(presented) is None:
                refusal = "/metrics needs an API key or a metrics key (Authorization: Bearer KEY)"
        elif path.startswith("/admin/") and self.admin_keys.enabled:
            if self.admin_keys.identify(presented) is None:
                refusal = "/admin needs an admin key (Authorization: Bearer KEY)"
        elif self.keys.enabled and key_id is None and path.startswith(("/v1/", "/api/", "/admin/")):
            refusal = "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)"
        address = (scope.get("client") or ("?",))[0]
        if refusal is not None:
            self.refusals.refused(address, path)
            return await _reject(scope, send, 401, refusal, "invalid_api_key")
        state = scope.setdefault("state", {})
        state["authenticated"] = key_id is not None or not self.keys.enabled
        state["client_id"] = key_id or address
        state["key_id"] = key_id
        state["keep_alive_limit_s"] = self.keep_alive_limit_s
        return await self.app(scope, receive, send)

    def _origin_allowed(self, headers: dict[bytes, bytes]) -> bool:
        """A page of an origin --cors-origin names, or a local app's."""
        origin = headers.get(b"origin", b"")
        return self.any_origin or origin in self.origins or self.local_app_origin.fullmatch(origin) is not None

    def _host_allowed(self, host: bytes) -> bool:
        name = host.decode("latin-1").lower()
        if name.startswith("["):
            name = name[: name.find("]") + 1]
        else:
            name = name.rsplit(":", 1)[0]
        # No page can make an address its own origin; beyond loopback, clients name the server by one.
        return (name in self.allowed_hosts or name.endswith(RESERVED_SUFFIXES)
                or not self.loopback and ip_address(name) is not None)


def keep_alive_for(request: Request, keep_alive_s: float | None) -> float | None:
    """The keep_alive a request may set. With admin keys, unloading a model
    is an operator's act (keep_alive 0: a 403 for the API keys), and so is
    keeping it loaded longer than the server's own --keep-alive, or for
    good: such a keep_alive is taken as the server's, as clients send one
    with every request (Continue: 30 minutes). A shorter one is raised to the
    server's too, since it would unload the model as soon after the request
    (a millisecond) as 0 would."""
    limit = request.scope.get("state", {}).get("keep_alive_limit_s")
    if limit is None or keep_alive_s is None:
        return keep_alive_s
    if keep_alive_s == 0:
        raise APIError(403, "on this server, unloading a model (keep_alive 0) takes an admin key: "
                            "POST /admin/models/{name}/unload", param="keep_alive", code="admin_key_required")
    return limit


def cross_site(headers: dict[bytes, bytes]) -> bool:
    """A browser's request from a page of another origin: browsers say so
    (Sec-Fetch-Site), or name the page's origin, which then differs from the
    Host the request was sent to. Clients that are not browsers send neither."""
    if headers.get(b"sec-fetch-site", b"same-origin") not in (b"same-origin", b"none"):
        return True
    origin = headers.get(b"origin")
    return origin is not None and origin.partition(b"://")[2] != headers.get(b"host", b"")


class RefusalLog:
    """A log line for the requests refused for their key, at most one a
    minute per client address: who is guessing at keys shows in the log,
    which a flood of guesses does not fill."""

    EVERY_S = 60.0
    MAX_ADDRESSES = 1024  # remembered at once; beyond, forgotten all together

    def __init__(self) -> None:
        self._since: dict[str, tuple[float, int]] = {}  # address -> (when its last line was logged, refused since)

    def refused(self, address: str, path: str) -> None:
        now = time.monotonic()
        logged_at, count = self._since.get(address, (-self.EVERY_S, 0))
        if now - logged_at < self.EVERY_S:
            self._since[address] = (logged_at, count + 1)
            return
        if len(self._since) >= self.MAX_ADDRESSES:
            self._since.clear()
        self._since[address] = (now, 0)
        log.warning("refused a request from %s to %s for a missing or wrong key%s", address, path,
                    f" ({count} more since the last such line)" if count else "")


async def _reject(scope, send, status: int, message: str, code: str) -> None:
    body = error_payload(scope, status, message, "invalid_request_error", None, code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

"""The HTTP server's own settings (authentication, request limits, timeouts, context-cache quotas, shutdown).

One dataclass, one `--flag` per field with its help text; the keys can also come from the
environment (`MESHSERVE_API_KEY`, comma-separated for several, and `MESHSERVE_ADMIN_KEY`) so
they need not appear in a process listing. `check_bind` refuses to serve beyond loopback
without an API key unless the operator waives it explicitly.
"""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
from dataclasses import dataclass, field

from meshserve.config import ConfigError
from meshserve.entrypoints.openai.context_caches import MAX_TTL_S
from meshserve.utils import envs

API_KEY_ENV = envs.MESHSERVE_API_KEY.name
ADMIN_KEY_ENV = envs.MESHSERVE_ADMIN_KEY.name
# a token is rarely longer than a few characters; 32 leaves room for long runs of spaces or digits
PROMPT_CHARS_PER_TOKEN = 32
_SECRET_FIELDS = ("api_keys", "admin_key")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class ServerOptions:
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None
    allow_unauthenticated: bool = field(default=False, metadata=_help(
        "serve beyond loopback without an API key (the API is then open to anyone who can reach it)"))
    max_body_bytes: int = field(default=4 * 1024 * 1024, metadata=_help(
        "largest request body; larger ones get 413 before anything is parsed"))
    max_prompt_chars: int | None = field(default=None, metadata=_help(
        "longest prompt (characters, all messages together) accepted for tokenizing; longer ones get 400 "
        f"(default: max_model_len x {PROMPT_CHARS_PER_TOKEN})"))
    header_timeout_s: float = field(default=10.0, metadata=_help(
        "seconds a connection may take to send a request's headers before it is closed"))
    body_timeout_s: float = field(default=30.0, metadata=_help(
        "seconds a client may take to send a request body (408 after it)"))
    write_timeout_s: float = field(default=30.0, metadata=_help(
        "seconds a response may wait for a client that does not read it; then the stream is cut and its "
        "request aborted"))
    max_connections: int = field(default=1024, metadata=_help(
        "open connections (and requests) served at once; beyond it new requests get 503"))
    shutdown_grace_s: float = field(default=10.0, metadata=_help(
        "on SIGTERM/SIGINT: seconds running requests get to finish; then each stream ends with an error event "
        "and [DONE]"))
    max_context_cache_ttl: float = field(default=3600.0, metadata=_help(
        "longest ttl_seconds a context cache may ask for (longer: 400)"))
    context_caches_per_key: int = field(default=16, metadata=_help(
        "context caches one API key (or one client address without keys) may hold at once"))
    context_cache_tokens_per_key: int | None = field(default=None, metadata=_help(
        "prefix tokens one API key (or client) may keep pinned in context caches (default: max_model_len)"))
    context_caches_total: int = field(default=1024, metadata=_help("context caches held at once, all keys together"))
    enable_fault_injection: bool = field(default=False, metadata=_help(
        "tests and benchmarks only: open POST /admin/faults, which kills, stalls or breaks parts of the "
        f"deployment on request (default: ${envs.MESHSERVE_FAULT_INJECTION.name})"))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
                raise ConfigError(f"--{f.name.replace('_', '-')} must be > 0, got {value}")
        if any(not key for key in self.api_keys) or self.admin_key == "":
            raise ConfigError("an API or admin key must not be empty")
        if self.max_context_cache_ttl > MAX_TTL_S:
            raise ConfigError(f"--max-context-cache-ttl may be at most {MAX_TTL_S:g} s")

    def __repr__(self) -> str:  # never print the keys
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _SECRET_FIELDS}
        return f"ServerOptions(api_keys={len(self.api_keys)}, admin_key={self.admin_key is not None}, {shown})"

    @property
    def secrets_env(self) -> dict[str, str]:
        """The keys as environment variables, for a child process that serves the same API."""
        env = {}
        if self.api_keys:
            env[API_KEY_ENV] = ",".join(self.api_keys)
        if self.admin_key:
            env[ADMIN_KEY_ENV] = self.admin_key
        return env

    def public_kwargs(self) -> dict:
        """Every setting but the keys (those travel in the environment, see `secrets_env`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _SECRET_FIELDS}


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's flags, one per ServerOptions field."""
    group = parser.add_argument_group("HTTP server")
    group.add_argument("--api-key", dest="api_keys", action="append", default=None,
                       help=f"key every /v1 request must send as `Authorization: Bearer KEY` (repeatable; "
                            f"default: ${API_KEY_ENV}, comma-separated)")
    group.add_argument("--admin-key", dest="admin_key", default=None,
                       help=f"key for /admin/* and the context-cache listing (default: ${ADMIN_KEY_ENV}; "
                            "without one those endpoints answer loopback clients only)")
    for f in dataclasses.fields(ServerOptions):
        if f.name in _SECRET_FIELDS:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            group.add_argument(flag, dest=f.name, action="store_true", help=f.metadata["help"])
            continue
        help_text = f.metadata["help"]
        if f.default is not None and "default:" not in help_text:
            help_text += f" (default: {f.default})"
        kind = float if "float" in str(f.type) else int  # annotations are strings here
        group.add_argument(flag, dest=f.name, type=kind, default=f.default, help=help_text)


def server_options_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServerOptions:
    """The flags given, with the keys from the environment where no flag names them."""
    return server_options(environ, **{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerOptions)
                                      if hasattr(args, f.name)})


def server_options(environ: dict[str, str] | None = None, **kwargs) -> ServerOptions:
    """ServerOptions from keyword settings, the keys defaulting to the environment's."""
    if not kwargs.get("api_keys"):
        kwargs["api_keys"] = envs.api_keys(environ)
    if kwargs.get("admin_key") is None:
        kwargs["admin_key"] = envs.admin_key(environ)
    kwargs["api_keys"] = tuple(kwargs["api_keys"])
    if not kwargs.get("enable_fault_injection"):
        kwargs["enable_fault_injection"] = envs.fault_injection_enabled(environ)
    return ServerOptions(**kwargs)


def is_loopback_host(host: str) -> bool:
    """Whether binding `host` keeps the server reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, options: ServerOptions) -> None:
    """Refuse (one line) to open the API beyond loopback without a key, unless explicitly waived."""
    if is_loopback_host(host) or options.api_keys or options.allow_unauthenticated:
        return
    raise ConfigError(f"refusing to serve on {host} without an API key: set --api-key (or ${API_KEY_ENV}), "
                      f"or pass --allow-unauthenticated to serve an open API")

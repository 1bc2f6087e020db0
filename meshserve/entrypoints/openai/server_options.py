"""The HTTP server's own settings (authentication, request limits, timeouts, context-cache quotas, shutdown,
per-tenant limits).

One settings struct (`ConfigStruct`): each rule and help text sits on the field, and the flags are generated
from it (`add_struct_arguments`). The keys are the exception: they have flags of their own and can also come
from the environment (`MESHSERVE_API_KEY`, comma-separated for several, and `MESHSERVE_ADMIN_KEY`) so they
need not appear in a process listing, and they never show in the repr. `check_bind` refuses to serve beyond
loopback without an API key unless the operator waives it explicitly.

The struct stays with the HTTP layer: only the frontend reads it, its ceilings are the HTTP layer's (the
context caches' longest ttl), and a cluster manager hands it on to its frontends as plain keyword settings.
"""
from __future__ import annotations

import argparse
import ipaddress
from typing import Annotated

import msgspec
from msgspec import Meta

from meshserve.config import ConfigError, ConfigStruct
from meshserve.config.arguments import add_struct_arguments, given_settings
from meshserve.entrypoints.openai.cache_namespaces import parse_shared_cache_keys
from meshserve.entrypoints.openai.context_caches import MAX_TTL_S
from meshserve.entrypoints.openai.reasoning import REASONING_PARSERS
from meshserve.entrypoints.openai.tool_parsers import TOOL_CALL_FORMATS
from meshserve.utils import envs

API_KEY_ENV = envs.MESHSERVE_API_KEY.name
ADMIN_KEY_ENV = envs.MESHSERVE_ADMIN_KEY.name
# a token is rarely longer than a few characters; 32 leaves room for long runs of spaces or digits
PROMPT_CHARS_PER_TOKEN = 32
_SECRET_FIELDS = ("api_keys", "admin_key")
# the default token budget of one request: this many full contexts (prompt + completion)
TOKENS_PER_REQUEST_CONTEXTS = 32


class TenantLimits(ConfigStruct, frozen=True):
    """What one client address or one tenant (an API key's owner; the client address without keys) may hold.

    The defaults change nothing for a single local user (half the server's connections, half its requests,
    no token budget) yet keep any one client or key from holding all of a shared server; a multi-tenant
    operator sets a token budget that fits the model and the hardware."""

    max_connections_per_client: Annotated[int, Meta(
        gt=0, description="open connections one client address may hold (counted before its key is known); "
                          "requests on more get 429 and the connection is closed")] = 512
    max_requests_per_tenant: Annotated[int, Meta(
        gt=0, description="requests one API key (or one client address without keys) may have running at once; "
                          "more get 429")] = 512
    tokens_per_minute_per_tenant: Annotated[int, Meta(
        gt=0, description="token budget of one API key (or client address without keys) per minute, prompt plus "
                          "max_tokens reserved on admission and corrected with the tokens used when the request "
                          "ends; beyond it 429 (default: no budget)")] | None = None
    token_burst_s: Annotated[float, Meta(
        gt=0, le=3600, description="seconds of its token budget a tenant may spend at once (the token bucket's "
                                   "size); less smooths a tenant's bursts")] = 60.0


class ServerOptions(ConfigStruct, frozen=True):
    api_keys: tuple[str, ...] = ()  # secret: its own flag (--api-key) and environment variable
    admin_key: str | None = None  # secret: its own flag (--admin-key) and environment variable
    allow_unauthenticated: Annotated[bool, Meta(
        description="serve beyond loopback without an API key (the API is then open to anyone who can reach it)")
    ] = False
    max_body_bytes: Annotated[int, Meta(
        gt=0, description="largest request body; larger ones get 413 before anything is parsed")] = 4 * 1024 * 1024
    max_prompt_chars: Annotated[int, Meta(
        gt=0, description="longest prompt (characters, all messages together) accepted for tokenizing; longer ones "
                          f"get 400 (default: max_model_len x {PROMPT_CHARS_PER_TOKEN})")] | None = None
    max_choices_per_request: Annotated[int, Meta(
        gt=0, description="choices one request may ask for (prompts x n); more get 400 before anything is tokenized "
                          "or sent to the engine")] = 128
    max_tokens_per_request: Annotated[int, Meta(
        gt=0, description="tokens one request's choices may hold together (n x (prompt + max_tokens), summed over "
                          f"its prompts); more get 400 (default: max_model_len x {TOKENS_PER_REQUEST_CONTEXTS})")
    ] | None = None
    max_waiting_choices: Annotated[int, Meta(
        gt=0, description="choices of all running requests together that may wait for their first token; a request "
                          "beyond it gets 503 queue_full before any of its choices is sent (default: the engine's "
                          "--max-waiting; a deployment's: the sum over its colocated and prefill TEs)")] | None = None
    header_timeout_s: Annotated[float, Meta(
        gt=0, description="seconds a connection may take to send a request's headers before it is closed")] = 10.0
    body_timeout_s: Annotated[float, Meta(
        gt=0, description="seconds a client may take to send a request body (408 after it)")] = 30.0
    write_timeout_s: Annotated[float, Meta(
        gt=0, description="seconds a response may wait for a client that does not read it; then the stream is cut "
                          "and its request aborted")] = 30.0
    max_connections: Annotated[int, Meta(
        gt=0, description="open connections (and requests) served at once; beyond it new requests get 503")] = 1024
    shutdown_grace_s: Annotated[float, Meta(
        gt=0, description="on SIGTERM/SIGINT: seconds running requests get to finish; then each stream ends with an "
                          "error event and [DONE]")] = 10.0
    max_context_cache_ttl: Annotated[float, Meta(
        gt=0, le=MAX_TTL_S, description="longest ttl_seconds a context cache may ask for (longer: 400)")] = 3600.0
    context_caches_per_key: Annotated[int, Meta(
        gt=0, description="context caches one API key (or one client address without keys) may hold at once")] = 16
    context_cache_tokens_per_key: Annotated[int, Meta(
        gt=0, description="prefix tokens one API key (or client) may keep pinned in context caches "
                          "(default: max_model_len)")] | None = None
    context_caches_total: Annotated[int, Meta(
        gt=0, description="context caches held at once, all keys together")] = 1024
    shared_cache_keys: Annotated[str, Meta(
        description="API keys whose requests share one prefix-cache namespace (their cached prompts show in each "
                    "other's cached_tokens and timing): groups separated by ';', each a comma-separated list of key "
                    "fingerprints (the first 16 hex digits of the key's SHA-256), or '*' for one namespace shared by "
                    "every key and client; unset, each key (or keyless client address) has its own")] = ""
    enable_fault_injection: Annotated[bool, Meta(
        description="tests and benchmarks only: open POST /admin/faults, which kills, stalls or breaks parts of the "
                    f"deployment on request (also on when ${envs.MESHSERVE_FAULT_INJECTION.name} is set)")] = False
    tool_call_parser: Annotated[str, Meta(
        description="how the model writes tool calls, read for tool_choice 'auto': "
                    f"{', '.join(TOOL_CALL_FORMATS)} (default: the format of the model's chat template)")] | None = None
    reasoning_parser: Annotated[str, Meta(
        description="split a reasoning model's <think> part into reasoning_content: "
                    f"{', '.join(REASONING_PARSERS)} (default: none, the text stays whole)")] | None = None
    # flags of their own group (add_server_arguments); its settings travel flat (public_kwargs)
    tenant_limits: TenantLimits = TenantLimits()

    def __post_init__(self) -> None:
        # the keys first, and in words: the generic message would print the value, a key
        if any(not key for key in self.api_keys) or self.admin_key == "":
            raise ConfigError("an API or admin key must not be empty")
        parse_shared_cache_keys(self.shared_cache_keys)  # a bad group stops the server before it serves
        for name, value, known in (("tool_call_parser", self.tool_call_parser, TOOL_CALL_FORMATS),
                                   ("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)):
            if value is not None and value not in known:
                raise ConfigError(f"{name} {value!r} is not one of {', '.join(known)}")
        super().__post_init__()

    def __repr__(self) -> str:  # never print the keys
        return (f"ServerOptions(api_keys={len(self.api_keys)}, admin_key={self.admin_key is not None}, "
                f"{self.public_kwargs()})")

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
        """Every setting but the keys (those travel in the environment, see `secrets_env`), the tenant limits'
        among them: `server_options(**public_kwargs())` makes the same options."""
        kwargs = {name: getattr(self, name) for name in self.__struct_fields__
                  if name not in _SECRET_FIELDS and name != "tenant_limits"}
        return {**kwargs, **msgspec.structs.asdict(self.tenant_limits)}  # flat, as the flags name them


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's flags: the keys', then one per other ServerOptions setting."""
    keys = parser.add_argument_group("HTTP server keys")
    keys.add_argument("--api-key", dest="api_keys", action="append", default=None,
                      help=f"key every /v1 request must send as `Authorization: Bearer KEY` (repeatable; "
                           f"default: ${API_KEY_ENV}, comma-separated)")
    keys.add_argument("--admin-key", dest="admin_key", default=None,
                      help=f"key for /admin/* and the context-cache listing (default: ${ADMIN_KEY_ENV}; "
                           "without one those endpoints answer loopback clients only)")
    add_struct_arguments(parser, ServerOptions, "HTTP server", skip=_SECRET_FIELDS)
    add_struct_arguments(parser, TenantLimits, "Tenant limits")


def server_options_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServerOptions:
    """The flags given, with the keys from the environment where no flag names them."""
    return server_options(environ, api_keys=getattr(args, "api_keys", None) or (),
                          admin_key=getattr(args, "admin_key", None), **given_settings(args, ServerOptions),
                          **given_settings(args, TenantLimits))


def server_options(environ: dict[str, str] | None = None, **kwargs) -> ServerOptions:
    """ServerOptions from keyword settings, the keys defaulting to the environment's."""
    if not kwargs.get("api_keys"):
        kwargs["api_keys"] = envs.api_keys(environ)
    if kwargs.get("admin_key") is None:
        kwargs["admin_key"] = envs.admin_key(environ)
    kwargs["api_keys"] = tuple(kwargs["api_keys"])
    tenant_settings = {name: kwargs.pop(name) for name in TenantLimits.__struct_fields__ if name in kwargs}
    if tenant_settings:
        kwargs["tenant_limits"] = TenantLimits(**tenant_settings)
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

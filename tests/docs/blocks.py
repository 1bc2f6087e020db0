"""The fenced blocks of the documentation that are marked runnable, and how the docs test rewrites them.

A block is runnable when its info string has `runnable` after the language (docs/development.md,
"The docs are tested"): ```` ```bash runnable ````, ```` ```python runnable ````, or
```` ```bash runnable server ```` for the one `meshserve serve` command the page's later blocks talk to.
Anything else after `runnable` is an error, so a misspelt marker fails rather than silently skipping.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = "runnable"
SERVER = "server"
SHELL_LANGUAGES = ("bash", "sh", "shell")
PYTHON_LANGUAGES = ("python", "py")
# the port the docs' examples use (`meshserve serve`'s default); the test points it at its own server
DOCS_PORT = 8000
_FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")
_DOCS_ADDRESS = re.compile(rf"\b(?:127\.0\.0\.1|localhost):{DOCS_PORT}\b")
_PORT_FLAG = re.compile(r"--port[ =]\d+")


class MarkerError(ValueError):
    """A runnable block whose info string or body the test cannot run."""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str  # "bash" or "python"
    server: bool
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    """README.md, SECURITY.md and every page of docs/."""
    return [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]


def fenced_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line of the opening fence, info string, body) of every fenced block of a Markdown file."""
    blocks, opening, info, body = [], None, "", []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = _FENCE.match(line)
        if opening is None:
            if match:
                opening, info, body = (number, match.group(1)), match.group(2).strip(), []
        elif match and match.group(1).startswith(opening[1]) and not match.group(2).strip():
            blocks.append((opening[0], info, "\n".join(body) + "\n"))
            opening = None
        else:
            body.append(line)
    return blocks


def parse_info(info: str) -> tuple[str, bool, bool] | None:
    """(language, runnable, server) of an info string; None for a block that is documentation only."""
    words = info.split()
    if RUNNABLE not in words[1:]:
        return None
    language, flags = words[0], words[2:]
    if words[1] != RUNNABLE or any(flag != SERVER for flag in flags) or len(flags) > 1:
        raise MarkerError(f"info string {info!r}: write `LANGUAGE runnable` or `LANGUAGE runnable server`")
    if language in SHELL_LANGUAGES:
        return "bash", True, bool(flags)
    if language in PYTHON_LANGUAGES and not flags:
        return "python", True, False
    raise MarkerError(f"info string {info!r}: runnable blocks are shell or python; a server block is shell")


def runnable_blocks(path: Path) -> list[Block]:
    """The runnable blocks of one file, in order; MarkerError names the file and line of a bad one."""
    found = []
    for line, info, text in fenced_blocks(path):
        where = f"{path.relative_to(ROOT)}:{line}"
        try:
            parsed = parse_info(info)
        except MarkerError as exc:
            raise MarkerError(f"{where}: {exc}") from None
        if parsed is None:
            continue
        language, _, server = parsed
        if server and not is_serve_command(text):
            raise MarkerError(f"{where}: a server block holds one `meshserve serve` command, got {text.strip()!r}")
        found.append(Block(path, line, language, server, text))
    return found


def is_serve_command(text: str) -> bool:
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return len(lines) == 1 and re.search(r"(^|\s)meshserve serve(\s|$)", lines[0]) is not None


def server_command(block: Block, port: int) -> str:
    """The server block's command listening on `port`: its `--port` replaced, else one added."""
    command = " ".join(line for line in block.text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    if _PORT_FLAG.search(command):
        return _PORT_FLAG.sub(f"--port {port}", command)
    return f"{command} --port {port}"


def point_at_port(text: str, port: int) -> str:
    """A block's text with the docs' address (127.0.0.1:8000, localhost:8000) moved to `port`."""
    return _DOCS_ADDRESS.sub(f"127.0.0.1:{port}", text)


def uses_docs_port(text: str) -> bool:
    return _DOCS_ADDRESS.search(text) is not None

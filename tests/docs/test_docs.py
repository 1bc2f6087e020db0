"""Every runnable block of README.md, SECURITY.md and docs/*.md runs and succeeds (docs/development.md,
"The docs are tested"): one test per page, its blocks in order in a directory of its own.

The servers start in the background before the first page runs, and the pages that need none run first,
so a server's start-up overlaps them."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT, doc_files, point_at_port, runnable_blocks, uses_docs_port
from tests.docs.runner import DocsServers, docs_environment, run_block

RUNNABLE = {path: runnable_blocks(path) for path in doc_files() if path.is_file()}
PAGES = sorted((path for path, blocks in RUNNABLE.items() if blocks),
               key=lambda path: any(block.server for block in RUNNABLE[path]))


@pytest.fixture(scope="module")
def docs_run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("docs-run")


@pytest.fixture(scope="module")
def docs_env(docs_run_dir) -> dict[str, str]:
    return docs_environment(docs_run_dir)


@pytest.fixture(scope="module")
def docs_servers(request, docs_run_dir, docs_env) -> Iterator[DocsServers]:
    servers = DocsServers(docs_run_dir, docs_env)
    selected = {item.callspec.params["page"] for item in request.session.items
                if "page" in getattr(getattr(item, "callspec", None), "params", {})}
    try:
        for path in PAGES:
            for block in RUNNABLE[path] if path in selected else ():
                if block.server:
                    servers.start(block)
        yield servers
    finally:
        servers.stop_all()


@pytest.mark.parametrize("page", PAGES, ids=[str(path.relative_to(ROOT)) for path in PAGES])
def test_runnable_blocks_of_the_page_succeed(page: Path, docs_env, docs_servers, tmp_path):
    port = None
    for block in RUNNABLE[page]:
        if block.server:
            port = docs_servers.port_for(block)
            continue
        text = block.text
        if uses_docs_port(text):
            if port is None:
                pytest.fail(f"{block.where}: talks to port 8000, but no server block comes before it on its page")
            text = point_at_port(text, port)
        run_block(block, text, tmp_path, docs_env)

"""Which fenced blocks the docs test runs, and how it points them at its own server."""
from __future__ import annotations

import pytest

from tests.docs import blocks
from tests.docs.blocks import Block, MarkerError, parse_info, point_at_port, runnable_blocks, server_command


@pytest.mark.parametrize("info, parsed", [
    ("bash", None),
    ("", None),
    ("python", None),
    ("yaml", None),
    ("bash runnable", ("bash", True, False)),
    ("sh runnable", ("bash", True, False)),
    ("python runnable", ("python", True, False)),
    ("bash runnable server", ("bash", True, True)),
])
def test_parse_info(info, parsed):
    assert parse_info(info) == parsed


@pytest.mark.parametrize("info", ["bash runnable sever", "bash runnable server server", "yaml runnable",
                                  "python runnable server", "bash server runnable"])
def test_a_misspelt_or_unsupported_marker_is_an_error(info):
    with pytest.raises(MarkerError):
        parse_info(info)


def test_runnable_blocks_keep_order_line_and_text(tmp_path, monkeypatch):
    monkeypatch.setattr(blocks, "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n```bash\nmake serve\n```\n\n```bash runnable server\nmeshserve serve\n```\n\n"
                    "````python runnable\nprint('```')\n````\n")
    found = runnable_blocks(page)
    assert [(b.line, b.language, b.server, b.text) for b in found] == [
        (7, "bash", True, "meshserve serve\n"), (11, "python", False, "print('```')\n")]
    assert found[0].where == "page.md:7"


@pytest.mark.parametrize("text", ["meshserve serve\nmeshserve serve\n", "curl -s localhost:8000/health\n"])
def test_a_server_block_holds_one_serve_command(tmp_path, monkeypatch, text):
    monkeypatch.setattr(blocks, "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text(f"```bash runnable server\n{text}```\n")
    with pytest.raises(MarkerError, match="page.md:1"):
        runnable_blocks(page)


@pytest.mark.parametrize("text, command", [
    ("meshserve serve\n", "meshserve serve --port 4321"),
    ("# the default model\nMESHSERVE_API_KEY=k meshserve serve --port 8000 --max-num-seqs 4\n",
     "MESHSERVE_API_KEY=k meshserve serve --port 4321 --max-num-seqs 4"),
    ("meshserve serve --port=9000\n", "meshserve serve --port 4321"),
])
def test_server_command_listens_on_the_given_port(tmp_path, text, command):
    block = Block(tmp_path / "page.md", 1, "bash", True, text)
    assert server_command(block, 4321) == command


def test_the_docs_address_moves_to_the_test_port():
    text = "curl -s http://127.0.0.1:8000/v1/models localhost:8000/health 127.0.0.1:80001 host:8000\n"
    assert point_at_port(text, 4321) == \
        "curl -s http://127.0.0.1:4321/v1/models 127.0.0.1:4321/health 127.0.0.1:80001 host:8000\n"


@pytest.mark.parametrize("path", blocks.doc_files(), ids=lambda path: str(path.relative_to(blocks.ROOT)))
def test_the_runnable_markers_of_every_page_are_well_formed(path):
    for block in runnable_blocks(path):
        assert block.language in ("bash", "python")

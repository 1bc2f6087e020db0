"""The draft vocabulary (FR-Spec): written from token counts, read back, refused when malformed."""
from __future__ import annotations

import json

import pytest

from meshserve.models.draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab, write_draft_vocab


def test_ranks_by_count_then_id_and_reads_back_the_most_frequent(tmp_path):
    write_draft_vocab(tmp_path, [5, 0, 9, 5, 1], source="test text")
    assert json.loads((tmp_path / DRAFT_VOCAB_FILE).read_text())["token_ids"] == [2, 0, 3, 4, 1]
    assert load_draft_vocab(tmp_path, 3, vocab_size=5) == ([2, 0, 3], DRAFT_VOCAB_FILE)


def test_without_a_file_the_id_order_stands_in(tmp_path):
    ids, source = load_draft_vocab(tmp_path, 4, vocab_size=100)
    assert ids == [0, 1, 2, 3] and "id order" in source


@pytest.mark.parametrize("content", ['{"token_ids": [1, 1, 2]}', '{"token_ids": [0, 7]}', "not json", "{}"])
def test_a_malformed_file_is_refused_with_its_name(tmp_path, content):
    (tmp_path / DRAFT_VOCAB_FILE).write_text(content)
    with pytest.raises(ValueError, match=DRAFT_VOCAB_FILE):
        load_draft_vocab(tmp_path, 2, vocab_size=5)


def test_a_size_beyond_the_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match="speculative_draft_vocab"):
        load_draft_vocab(tmp_path, 6, vocab_size=5)

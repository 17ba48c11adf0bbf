"""Speculative steps (issue 18, in progress): the asker's draft sources and draft length.

Not yet here: the identity test through a swarm. A step of several positions does not always give
each position the bits that single steps give (swarmctl/speculate.py says what was found), so
greedy speculation is not yet token-identical to plain decoding, and no command turns it on."""

from __future__ import annotations

import pytest

from swarmctl.speculate import DraftLength, NgramDraft, speculation_for

def test_ngram_lookup_proposes_what_followed_the_latest_match():
    draft = NgramDraft(max_ngram=3)
    assert draft.propose([1, 2, 3, 9, 9, 1, 2, 3], 3) == [9, 9, 1]  # the 3-gram [1, 2, 3] came before
    assert draft.propose([5, 1, 2, 7, 1, 2, 8, 1, 2], 2) == [8, 1]  # the latest earlier occurrence wins
    assert draft.propose([4, 5, 6], 4) == []  # nothing repeats
    assert draft.propose([1, 2, 1], 0) == []
    assert draft.propose([7, 3, 7], 5) == [3, 7]  # as much as there is


def test_draft_length_grows_on_success_and_backs_off_to_plain_steps():
    length = DraftLength(k=2, k_max=4, retry_after=3)
    length.update(2, 2)
    assert length.k == 3
    length.update(3, 3)
    length.update(4, 4)
    assert length.k == 4  # capped
    length.update(4, 0)
    length.update(2, 0)
    length.update(1, 0)
    assert length.k == 0
    assert [length.next() for _ in range(3)] == [0, 0, 1]  # plain steps, then one draft to try again
    with pytest.raises(ValueError, match="--speculate 'magic'"):
        speculation_for("magic")

"""The asker's windows in flight, driven directly (no engines, no event loop: tasks are stand-in
strings): swarmctl/asker/windows.py. tests/test_speculation*.py and tests/test_pipelining.py run
the same decisions through the asker and a swarm, token for token against plain runs."""

from plans.whatif import MAX_WINDOWS
from swarmctl.asker.speculate import Draft, DraftLength
from swarmctl.asker.windows import Window, Windows


def window(start: int, lead: list[int], drafts: list[int], name: str = "task") -> Window:
    return Window(start, lead, Draft(drafts, [None] * len(drafts)), name)


def test_the_first_step_after_the_prompt_has_room_for_drafts_up_to_max_tokens_and_the_context():
    flight = Windows(start=10, lead=[7], context=list(range(11)), max_context=64)
    assert flight.room(left=5) == 4  # the step's own token, then 4 more
    assert flight.room(left=100) == 64 - 10 - 1 - 1
    assert not flight.rewinds  # nothing was sent past position 10
    prompt_chunk = Windows(start=0, lead=list(range(20)), context=list(range(20)), max_context=64)
    assert prompt_chunk.room(left=100) == 64 - 20 - 1


def test_windows_go_out_while_under_the_cap_each_guessed_on_every_draft_before_it_kept():
    flight = Windows(start=10, lead=[7], context=[1, 2, 3], max_context=1000)
    flight.add(window(10, [7], [8, 9]))
    guess = flight.guess(left=100, cap=3, k=4)
    assert guess.start == 13 and guess.k == 4
    assert guess.context == [1, 2, 3, 8, 9]  # the context so far (7 included) and the first window's drafts
    flight.add(window(13, [20], [21, 22, 23]))
    guess = flight.guess(left=100, cap=3, k=4)
    assert guess.start == 17 and guess.context == [1, 2, 3, 8, 9, 20, 21, 22, 23]
    flight.add(window(17, [30], [31]))
    assert flight.guess(left=100, cap=3, k=4) is None  # the cap: 3 out


def test_the_cap_is_the_speculation_policys_shared_with_the_planner():
    assert DraftLength().max_windows == MAX_WINDOWS
    flight = Windows(start=0, lead=[1], context=[1], max_context=10_000)
    flight.add(window(0, [1], [2]))
    while (guess := flight.guess(left=1000, cap=DraftLength().max_windows, k=2)) is not None:
        flight.add(window(guess.start, [5], [6, 7]))
    assert len(flight.out) == MAX_WINDOWS


def test_no_window_goes_after_a_prompt_chunk_or_past_max_tokens_or_the_context():
    chunk = Windows(start=0, lead=[1, 2, 3], context=[1, 2, 3], max_context=100)
    chunk.add(window(0, [1, 2, 3], []))
    assert chunk.guess(left=50, cap=6, k=4) is None
    flight = Windows(start=10, lead=[7], context=[7], max_context=100)
    flight.add(window(10, [7], [8, 9]))  # if all is kept: 7's choice, 8, 9, then the window's own choice
    assert flight.guess(left=4, cap=6, k=4).k == 0  # room for the guessed lead only
    assert flight.guess(left=3, cap=6, k=4) is None  # the last window's own choice is the last token
    near_end = Windows(start=10, lead=[7], context=[7], max_context=14)
    near_end.add(window(10, [7], [8, 9]))  # ends at 13: its own choice goes at 13, the guess would need 14
    assert near_end.guess(left=100, cap=6, k=4) is None
    assert Windows(start=10, lead=[7], context=[7], max_context=16, out=[window(10, [7], [8, 9])]).guess(
        left=100, cap=6, k=4).k == 1


def test_a_chain_that_holds_moves_on_to_the_next_window_without_cancelling_it():
    flight = Windows(start=10, lead=[7], context=[7], max_context=100)
    flight.add(window(10, [7], [8, 9], "first"))
    flight.add(window(13, [20], [21], "second"))
    taken = flight.take()
    assert taken.task == "first" and flight.following.task == "second" and flight.filled == 15
    assert flight.verdict(taken, kept=2, chain_holds=True, last=20) == []
    assert (flight.start, flight.lead) == (13, [20]) and [w.task for w in flight.out] == ["second"]


def test_a_draft_that_falls_cancels_every_later_window_and_the_next_step_rewinds():
    flight = Windows(start=10, lead=[7], context=[7], max_context=100)
    flight.add(window(10, [7], [8, 9], "first"))
    flight.add(window(13, [20], [21], "second"))
    flight.add(window(15, [30], [31], "third"))
    taken = flight.take()
    fallen = flight.verdict(taken, kept=1, chain_holds=False, last=44)
    assert [w.task for w in fallen] == ["second", "third"] and flight.out == []
    assert (flight.start, flight.lead) == (12, [44])  # after 7 and the one kept draft, its correction next
    assert flight.rewinds  # the fallen windows sent positions up to 17: the next step drops them
    assert flight.room(left=10) == 9


def test_the_context_is_full_when_the_next_step_has_no_position_left():
    flight = Windows(start=10, lead=[7], context=[7], max_context=12)
    flight.add(window(10, [7], [8]))
    flight.verdict(flight.take(), kept=1, chain_holds=False, last=8)
    assert flight.start == 12 and flight.context_full

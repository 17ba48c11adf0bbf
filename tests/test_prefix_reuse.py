"""Prefix reuse across requests: a conversation's cache stays at the asker and at every stage.

The oracle rule holds with it: every answer is the tokens a run without reuse gives (and
llama-cpp-python's), for a conversation that grows past a prefill chunk and for a client that
edits an earlier turn. A stage keeps prefixes per account, evicts only the asking account's, and
a stage that lost one costs a replay from position 0, not an error.
"""

from __future__ import annotations

import asyncio
import secrets
from types import SimpleNamespace

import numpy as np
import pytest

from harness.oracle import judge, oracle_greedy
from kernels.gguf_file import GGUFFile
from kernels.sampling import SamplingParams
from kernels.slice import SliceEngine, Step
from kernels.spec import SliceSpec
from swarmctl.asker.head_tail import PREFILL_CHUNK, Asker, Generation, InprocTrunk, u_split
from swarmctl.asker.link import SwarmLink
from swarmctl.asker.speculate import speculation_for
from swarmctl.asker.prefixes import PrefixCache, PrefixEntry, Steps, chunk_bounds, resume_point
from swarmctl.batching import BatchRunner
from swarmctl.trunk.budget import Limits, MemberBudget
from net import messages as m
from net.wire import FRAME_HEADER
from swarmctl.commands.status import fetch_status, format_table
from swarmctl.node.local_swarm import LocalSwarm
from plans.options import PlannerSettings
from swarmctl.trunk.prefixes import StagePrefixes
from tests.conftest import N_THREADS, run_split

GREEDY = SamplingParams(temperature=0)
CHUNK = 512
SMALL_CHUNK = 128  # the swarm and conversation tests: prompts a quarter as long cross a chunk the same way


# --- which cells may be reused: never a one-row step where a plain run has several ---

def test_new_positions_go_in_the_chunks_a_plain_run_uses():
    assert chunk_bounds(0, 1100, CHUNK) == [(0, 512), (512, 512), (1024, 76)]
    assert chunk_bounds(300, 1100, CHUNK) == [(300, 212), (512, 512), (1024, 76)]


def test_a_resume_point_leaves_no_one_row_step():
    kept = Steps(((0, 512), (512, 300)))
    assert resume_point(kept, 812, 900, CHUNK) == 812
    assert resume_point(kept, 2000, 812, CHUNK) == 811 - 0 - 1  # the last token runs: its cut would leave a row
    assert resume_point(kept, 513, 900, CHUNK) == 512  # a kept step cut to one row (its replay would decode)
    assert resume_point(kept, 511, 900, CHUNK) == 510  # a first new step [511, 512) of one row
    assert resume_point(kept, 512, 513, CHUNK) == 512  # ... unless a plain run has that one-row step too
    assert resume_point(kept, 1, 900, CHUNK) == 0
    assert resume_point(Steps(), 400, 900, CHUNK) == 0
    assert Steps(((0, 512), (512, 1))).exact() == Steps(((0, 512),))  # a one-row step's cell is not kept


def test_the_cache_hands_out_the_longest_prefix_once_and_drops_what_a_newer_one_holds():
    cache = PrefixCache(max_entries=2)
    short = PrefixEntry((1, 2, 3, 4), Steps(((0, 4),)))
    longer = PrefixEntry((1, 2, 3, 4, 5, 6), Steps(((0, 4), (4, 2))))
    edited = PrefixEntry((1, 2, 9, 9), Steps(((0, 4),)))
    assert cache.put(short) == [] and cache.put(longer) == [short]  # every prompt short serves, longer does
    assert cache.put(edited) == []
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    first = cache.take(prompt, CHUNK)
    assert (first.entry, first.start) == (longer, 6)
    second = cache.take(prompt, CHUNK)  # longer is in use now: the next best
    assert (second.entry, second.start) == (edited, 2)
    assert cache.take(prompt, CHUNK) is None and len(cache) == 0
    entries = [PrefixEntry((k, 1, 2), Steps(((0, 3),))) for k in range(3)]
    assert cache.put(entries[0]) == [] and cache.put(entries[1]) == [] and cache.put(entries[2]) == [entries[0]]


def test_a_resumed_request_names_its_prefix_once_and_replays_from_zero_after_a_failure():
    """The link's record (swarmctl/asker/replay.py): a resumed request's first route gets only the
    steps out, the first naming the prefix; any failure makes the next route replay everything."""
    from swarmctl.asker.replay import ReplayTable, SentStep

    rows = lambda start, n: SentStep(start, np.zeros((n, 4), np.float32), False)  # noqa: E731
    table = ReplayTable()
    table.resume(b"r", b"p" * 16, [rows(0, 512), rows(512, 88)])
    table.begin(b"r", rows(600, 40))
    assert table.resuming(b"r") == b"p" * 16
    first = table.opened(b"r", "conn", 4, 1)
    assert [(s.start_pos, len(s.hidden)) for s in first] == [(600, 40)]
    table.failed(b"r")
    assert table.resuming(b"r") == b""
    again = table.opened(b"r", "conn", 8, 1)
    assert [(s.start_pos, len(s.hidden)) for s in again] == [(0, 512), (512, 88), (600, 40)]
    table.answered(b"r", 600)
    (end,) = table.release(b"r", 1, keep=(b"q" * 16, 600))
    assert end.keep == (b"q" * 16, 600)

    # kept under another plan: the link replays at once rather than ask stages that may differ
    from swarmctl.asker.link import KeptSteps
    from swarmctl.asker.sending import RouteSender

    link = SimpleNamespace(plan=SimpleNamespace(version=2), table=ReplayTable(), recomputed=set(), resumed_under={})
    kept = KeptSteps([rows(0, 512), rows(512, 88)], plan_version=1)
    assert RouteSender.resume(link, b"s", b"p" * 16, 550, kept)
    assert link.table.resuming(b"s") == b"" and [len(h.hidden) for h in link.table.history(b"s")] == [512, 38]
    assert link.recomputed == {b"s"}  # (its usage reports none cached)
    link.plan.version = 1
    assert RouteSender.resume(link, b"t", b"p" * 16, 550, kept) and link.table.resuming(b"t") == b"p" * 16
    assert link.resumed_under == {b"t": 1}  # (a route opened under a later plan replays instead)


@pytest.mark.slow  # the bundled model in several slices: 5-6 s
def test_a_moved_cache_answers_as_one_computed_there(bundled_model):
    """The engine hands a request's cells to another id, cut to a position, without copying; a
    step from there gives the bits a fresh prefill gives."""
    tokens = [int(t) for t in np.random.default_rng(3).integers(100, 40000, 300)]
    with SliceEngine.open(bundled_model, SliceSpec(0, 30, has_embedding=True, has_lm_head=True),
                          n_threads=N_THREADS, max_context=512) as engine:
        fresh = engine.forward(b"fresh", start_pos=0, tokens=tokens, outputs="all")
        engine.forward(b"first", start_pos=0, tokens=tokens[:250], outputs="all")
        engine.forward(b"first", start_pos=250, tokens=tokens[250:251])  # a decode step: cut off below
        assert engine.move(b"first", b"kept", 250) and not engine.has_request(b"first")
        assert not engine.move(b"kept", b"next", 251)  # more positions than it holds
        assert engine.move(b"kept", b"next", 200)
        again = engine.forward(b"next", start_pos=200, tokens=tokens[200:], outputs="all")
        assert np.array_equal(again, fresh[200:])


# --- a conversation in one process: the same answers as without reuse, and as the oracle ---

async def _turns(model, prompts: list[list[int]], max_tokens: int, context: int,
                 speculate: bool = False, prefill_chunk: int = PREFILL_CHUNK) -> list[tuple[list[int], int, list[int]]]:
    """Each prompt with reuse, then without: (tokens with reuse, cached tokens, tokens without).
    ``speculate``: ngram drafts with three windows always in flight."""
    asker = Asker(model, 4, n_threads=N_THREADS, max_context=context, prefill_chunk=prefill_chunk)
    trunk = InprocTrunk(asker.gguf, u_split(asker.spec.n_layer, 4, 2).trunk, n_threads=N_THREADS,
                        max_context=context)
    cache = PrefixCache()
    out = []
    try:
        for prompt in prompts:
            runs = []
            for prefixes in (cache, None):
                gen = Generation(secrets.token_bytes(16), len(prompt))
                speculation = speculation_for("ngram", windows=3) if speculate else None
                async for _ in asker.generate(prompt, trunk, max_tokens=max_tokens, sampling=GREEDY, generation=gen,
                                              prefixes=prefixes, speculation=speculation):
                    pass
                runs.append(gen)
            out.append((runs[0].tokens, runs[0].cached_tokens, runs[1].tokens))
        # Every request ended: what is left is the kept prefixes, one per conversation state.
        assert all(e.n_requests == len(cache) for e in (asker.head, asker.tail, *trunk.engines))
    finally:
        trunk.close()
        asker.close()
    return out


def _chat(tokenizer, turns: list[str], answers: list[str]) -> list[int]:
    text = "".join(f"<|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"
                   for u, a in zip(turns, answers))
    text += f"<|im_start|>user\n{turns[len(answers)]}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode_prompt(text)


def test_a_conversation_answers_as_without_reuse_and_as_the_oracle(bundled_model, oracle):
    from kernels.tokenizer import Tokenizer

    tok = Tokenizer(bundled_model)
    turns = ["What colour is the sky?", "And the sea?", "Name one fish."]
    answers: list[str] = []
    prompts = []
    for i in range(len(turns)):
        prompts.append(_chat(tok, turns, answers))
        answers.append(["It is blue.", "Blue or green.", ""][i])
    # a client that edits an earlier turn: the common prefix (up to the edit) is reused
    prompts.append(_chat(tok, ["What colour is grass?", *turns[1:]], answers[:2]))
    results = asyncio.run(_turns(bundled_model, prompts, 12, 512))
    for (reused, cached, plain), prompt in zip(results, prompts):
        assert reused == plain, (cached, len(prompt))
    cached = [c for _, c, _ in results]
    assert cached[0] == 0 and 0 < cached[1] < len(prompts[1]) and cached[2] >= len(prompts[1]) - 1
    edit_at = next(i for i, (a, b) in enumerate(zip(prompts[3], prompts[2])) if a != b)
    assert 0 < cached[3] <= edit_at

    with GGUFFile(bundled_model) as gguf:
        engines = [SliceEngine(gguf, s, n_threads=N_THREADS, max_context=512)
                   for s in (SliceSpec(0, 15, has_embedding=True), SliceSpec(15, 30, has_lm_head=True))]
        try:
            for (reused, _, _), prompt in zip(results, prompts):
                verdict = judge(prompt, reused, oracle_greedy(oracle, prompt, 12),
                                lambda t: run_split(engines, t), oracle)
                assert verdict.passes, verdict.explain()
        finally:
            for e in engines:
                e.close()


@pytest.mark.slow  # the bundled model over 230 tokens, twice: 7 s
def test_a_conversation_past_a_prefill_chunk_answers_as_without_reuse(bundled_model):
    rng = np.random.default_rng(11)
    history = [int(t) for t in rng.integers(100, 40000, 75)]
    prompts = []
    for n in (75, 105, 50, 1):  # 75, 180 (past a chunk of 128), 230, and one new token
        history = history[:len(history)] + [int(t) for t in rng.integers(100, 40000, n)] if prompts else history
        prompts.append(list(history))
    # (chunks of 128, not the asker's 512: the same code path, a quarter of the prompt tokens)
    results = asyncio.run(_turns(bundled_model, prompts, 6, 512, prefill_chunk=SMALL_CHUNK))
    for reused, cached, plain in results:
        assert reused == plain
    assert [c for _, c, _ in results][1:] == [len(p) for p in prompts[:-1]][:2] + [len(prompts[3]) - 2]


def test_speculation_with_windows_in_flight_answers_as_without_reuse(bundled_model):
    """Drafted steps (one-row kernels per row) and rewinds come after the prompt: the kept cells
    are the prompt's only, and the answers stay those of a run without reuse."""
    text = "Copy this list: apples, pears, plums, apples, pears, plums, apples, pears, plums."
    from kernels.tokenizer import Tokenizer

    first = Tokenizer(bundled_model).encode_prompt(text)
    prompts = [first, first + first[1:], first + first[1:] + first[1:]]
    results = asyncio.run(_turns(bundled_model, prompts, 16, 512, speculate=True))
    for reused, cached, plain in results:
        assert reused == plain
    assert [c for _, c, _ in results] == [0, len(prompts[0]), len(prompts[1])]


# --- at a stage: prefixes are per account, and evicted within it ---

@pytest.fixture(scope="module")
def stage(bundled_model):
    engine = SliceEngine.open(bundled_model, SliceSpec(4, 8), n_threads=N_THREADS, max_context=512)
    runner = BatchRunner(engine)
    per_position = engine.kv_bytes_per_position
    # room for 3 caches of 256 cells per member: a flood must evict
    limits = Limits(64, 3 * 256 * per_position, 6 * 256 * per_position)
    held = SimpleNamespace(runner=runner, engine=engine, budget=MemberBudget(limits))
    yield held
    runner.close()
    engine.close()


def test_an_account_reaches_only_its_own_prefixes_and_evicts_only_them(stage):
    prefixes = StagePrefixes("stage-1", stage)
    hidden = np.random.default_rng(5).standard_normal((200, stage.engine.spec.n_embd)).astype(np.float32)

    async def prefill(rid: bytes, account: str) -> None:
        assert await prefixes.admit(rid, account, stage.engine.kv_bytes_after(rid, 200)) == ""
        await stage.runner.run(Step(rid, 0, hidden=hidden))

    async def run() -> None:
        mine, theirs = secrets.token_bytes(16), secrets.token_bytes(16)
        await prefill(b"a" * 16, "alice")
        assert await prefixes.keep(b"a" * 16, "alice", mine, 200, now=1.0)
        await prefill(b"b" * 16, "bob")
        assert await prefixes.keep(b"b" * 16, "bob", theirs, 200, now=1.0)
        # bob naming alice's id finds nothing (his own account's prefixes only), nor the reverse
        assert "no kept prefix" in await prefixes.resume(b"c" * 16, "bob", mine, 100)
        assert "no kept prefix" in await prefixes.resume(b"c" * 16, "alice", theirs, 100)
        assert stage.budget.usage("bob").kept_positions == 200
        # a flood of distinct prefixes from alice: only hers go, oldest first
        flood = [secrets.token_bytes(16) for _ in range(5)]
        for i, prefix in enumerate(flood):
            await prefill(bytes([i]) * 16, "alice")
            assert await prefixes.keep(bytes([i]) * 16, "alice", prefix, 200, now=1.0)
        assert stage.budget.usage("alice").kv_bytes <= stage.budget.limits.member_kv_bytes
        assert "no kept prefix" in await prefixes.resume(b"c" * 16, "alice", mine, 100)  # her oldest went
        assert await prefixes.resume(b"d" * 16, "alice", flood[-1], 150) == ""  # her newest is there
        assert stage.engine.position_of(b"d" * 16) == 150
        assert await prefixes.resume(b"e" * 16, "bob", theirs, 200) == ""  # bob's kept his
        for rid in (b"d" * 16, b"e" * 16):
            await stage.runner.call(stage.engine.release, rid)
            stage.budget.release(rid)

    asyncio.run(run())
    stats = stage.budget.stats()
    assert stats["members"]["alice"]["cached_tokens"] == 200 * (stage.budget.usage("alice").kept)



def test_a_kept_prefix_goes_once_idle_for_longer_than_the_reap_allows_by_the_clock_given(stage):
    prefixes = StagePrefixes("stage-1", stage)
    hidden = np.random.default_rng(6).standard_normal((50, stage.engine.spec.n_embd)).astype(np.float32)
    rid, prefix = secrets.token_bytes(16), secrets.token_bytes(16)

    async def run() -> tuple[str, str]:
        assert await prefixes.admit(rid, "carol", stage.engine.kv_bytes_after(rid, 50)) == ""
        await stage.runner.run(Step(rid, 0, hidden=hidden))
        assert await prefixes.keep(rid, "carol", prefix, 50, now=1000.0)
        await prefixes.reap(now=1500.0, idle_s=600.0)  # idle 500 s: kept
        kept = stage.budget.usage("carol").kept_positions
        await prefixes.reap(now=1601.0, idle_s=600.0)  # idle 601 s: freed
        return kept, await prefixes.resume(secrets.token_bytes(16), "carol", prefix, 10)

    kept, resumed = asyncio.run(run())
    assert kept == 50
    assert "no kept prefix" in resumed and stage.budget.usage("carol").kept_positions == 0

# --- through a swarm: stages keep the prefix; one that lost it costs a replay ---

@pytest.fixture(scope="module")
def local_swarm(bundled_model):
    with LocalSwarm(model=str(bundled_model), n_trunks=2, planner=PlannerSettings(head_layers=4)) as swarm:
        yield swarm


def test_a_swarm_keeps_the_prefix_and_a_lost_one_costs_a_replay(local_swarm, bundled_model):
    from tests.test_pipelining import trunk_stats

    async def run():
        link = await SwarmLink.open(local_swarm.asker_home, alive_check=local_swarm.check_alive, min_stages=2)
        asker = Asker(bundled_model, link.head_layers, n_threads=N_THREADS, max_context=512, prefill_chunk=SMALL_CHUNK)
        cache = PrefixCache()
        rng = np.random.default_rng(2)
        history = [int(t) for t in rng.integers(100, 40000, 40)]
        got = []
        try:
            for turn in range(4):
                if turn:
                    history += [int(t) for t in rng.integers(100, 40000, 150 if turn == 1 else 30)]  # 190: past a chunk
                if turn == 3:  # the stages never kept this id: as after an eviction or a restart
                    for entry in cache._entries.values():
                        entry.prefix = secrets.token_bytes(16)
                runs = []
                for prefixes in (cache, None):
                    gen = Generation(secrets.token_bytes(16), len(history))
                    async for _ in asker.generate(history, link, max_tokens=8, sampling=GREEDY, generation=gen,
                                                  prefixes=prefixes):
                        pass
                    runs.append(gen)
                got.append((runs[0].tokens, runs[0].cached_tokens, runs[1].tokens, len(history),
                            runs[0].prefix_recomputed))
            await asyncio.sleep(0.5)  # (the last END travels stage to stage unanswered)
            return got, await trunk_stats(local_swarm, link), link.stats.recoveries, await _status_once_cached(
                local_swarm, [s.member for s in link.plan.stages])
        finally:
            await link.close()
            asker.close()

    got, stats, recoveries, status = asyncio.run(run())
    for reused, cached, plain, n, _ in got:
        assert reused == plain, (cached, n)
    assert [g[1] for g in got] == [0, 40, 190, 220]
    assert [g[4] for g in got] == [False, False, False, True]  # (usage then reports none cached)
    assert recoveries == 1  # the lost prefix: replayed from position 0
    for s in stats:  # each stage shows what it keeps for the member (the orphaned one, and the last turn's)
        member = s["budget"]["members"]["asker"]
        assert member["cached_tokens"] >= 220 and member["requests"] == 0
        assert s["budget"]["cached_tokens"] == member["cached_tokens"]
    # `status` (the host, told by each trunk) shows what each stage keeps
    table = format_table(status)
    for s in stats:
        row = next(r for r in status.members if r.name == s["name"])
        assert row.cached_tokens == s["budget"]["cached_tokens"] and row.cached_kv_bytes > 0
        assert f"{s['name']}: keeps {row.cached_tokens} prompt tokens for askers' next requests" in table, table


async def _status_once_cached(swarm: LocalSwarm, stages: list[str], within_s: float = 15.0) -> m.Status:
    """The host's status once every stage has told it of its kept prefixes (a trunk tells it
    at its next tick, once a second)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        status = await fetch_status(swarm.asker_home)
        if all(r.cached_tokens for r in status.members if r.name in stages) \
                or asyncio.get_running_loop().time() > deadline:
            return status
        await asyncio.sleep(0.5)


def test_status_and_top_show_what_a_stage_keeps():
    from rich.console import Console

    from swarmctl.host.status import member_row  # noqa: F401 (the host's row: tested through the swarm above)
    from swarmctl.monitor.build import RawPoll, SnapshotBuilder
    from swarmctl.tui.widgets import NodeTable

    sent = m.decode(m.encode(m.Cached(tokens=3912, kv_bytes=42_000_000))[FRAME_HEADER.size:], m.Cached)
    row = m.MemberStatus(name="amy", role="trunk", may="trunk", address="127.0.0.1:7471", health="ready",
                         layers=[4, 10], memory=4_000_000_000, cached_tokens=sent.tokens, cached_kv_bytes=sent.kv_bytes)
    host = m.MemberStatus(name="host", role="host", may="host", address="127.0.0.1:7470", health="up (host)")
    status = m.Status(swarm="s", model="m.gguf", n_layer=26, head_layers=4, plan_version=3, complete=True,
                      missing_layers=[], members=[host, row], objective="", expected_ms_per_token=0.0,
                      expected_tokens_per_s=0.0, bottleneck="", warnings=[], recovery=m.RecoveryStatus())
    status = m.decode(m.encode(status)[FRAME_HEADER.size:], m.Status)
    assert "amy: keeps 3912 prompt tokens for askers' next requests (42.0 MB of KV cache)" in format_table(status)
    table = NodeTable()
    table.snapshot = SnapshotBuilder().add(RawPoll(0.0, 0.01, status, stats={}, pings_ms={}))
    console = Console(width=220, record=True)
    console.print(table.render())
    assert "3912 tok cached" in console.export_text()


def test_a_prefill_chunk_below_one_is_refused(bundled_model):
    with pytest.raises(ValueError, match="prefill_chunk must be 1 or more, not 0"):
        Asker(bundled_model, 4, prefill_chunk=0)

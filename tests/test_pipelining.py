"""Many requests in flight through a real local swarm (2 trunk processes): every one completes,
batching changes no token, caches never mix, memory returns to idle, admission waits and times out."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kernels.sampling import SamplingParams
from net.endpoint import Address, ask_member
from swarmctl.asker.head_tail import PREFILL_CHUNK, Asker, BusyError, InprocTrunk, generate_all, u_split
from swarmctl.node.local_swarm import LocalSwarm
from plans.options import PlannerSettings
from swarmctl.asker.link import ReroutePolicy, SwarmLink
from tests.conftest import N_THREADS

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def local_swarm(bundled_model):
    with LocalSwarm(model=str(bundled_model), n_trunks=2, planner=PlannerSettings(head_layers=4)) as swarm:
        yield swarm


def mixed_requests(n: int, seed: int = 5) -> list[tuple[list[int], int]]:
    """Prompts of 3-39 tokens, 4-15 new tokens each: lengths mixed enough that requests join and
    leave the stages' batches at every step (longer ones only cost the suite time)."""
    rng = np.random.default_rng(seed)
    return [([int(t) for t in rng.integers(100, 40000, int(rng.integers(3, 40)))], int(rng.integers(4, 16)))
            for _ in range(n)]


def solo_outputs(bundled_model, requests, prefill_chunk: int = PREFILL_CHUNK) -> list[list[int]]:
    """Each request alone, in one process (in-process and swarm runs are bit-identical: tested elsewhere).
    On one thread, though two took the 64 requests 12.0 s against 18.3: the asker computes on its
    executor's thread, and once that thread has run ggml on two threads, every later two-thread
    compute on another thread of this process ran about 1.8x slower (libgomp counts more threads
    than cores and makes every barrier sleep; in a full run, test_audit's table build after this
    module took 55 s instead of 31)."""
    asker = Asker(bundled_model, 4, n_threads=N_THREADS, prefill_chunk=prefill_chunk)
    trunk = InprocTrunk(asker.gguf, u_split(asker.spec.n_layer, 4, 2).trunk, n_threads=N_THREADS,
                        max_context=asker.max_context)

    async def run_all():
        return [(await generate_all(asker, p, trunk, max_tokens=m, sampling=GREEDY)).tokens for p, m in requests]

    try:
        return asyncio.run(run_all())
    finally:
        trunk.close()
        asker.close()


async def trunk_stats(swarm: LocalSwarm, link: SwarmLink) -> list[dict]:
    creds = swarm.asker_home.credentials()
    return [await ask_member(Address.parse(stage.address), creds, stage.member, {"type": "stats"})
            for stage in link.plan.stages]


def _idle(s: dict) -> bool:
    return s["requests"] == 0 and s["kv_bytes"] == 0 and s["routes"] == 0


async def settled_stats(swarm: LocalSwarm, link: SwarmLink, within_s: float = 10.0) -> list[dict]:
    """Each trunk's stats once every request is freed there, or as they are at the deadline.
    A request's END travels stage to stage without an answer, so the last stage may still be
    freeing the last request when the asker already has its tokens."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        stats = await trunk_stats(swarm, link)
        if all(_idle(s) for s in stats) or asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.2)


async def settled_stream_counts(swarm: LocalSwarm, link: SwarmLink, within_s: float = 10.0) -> list[int]:
    """Each trunk's open QUIC streams, once they stop falling (a stream is forgotten only after
    both sides' ends are acknowledged)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        counts = [s["open_streams"] for s in await trunk_stats(swarm, link)]
        if all(n <= 3 for n in counts) or asyncio.get_running_loop().time() > deadline:
            return counts
        await asyncio.sleep(0.5)


def test_64_concurrent_requests_match_their_solo_runs(local_swarm, bundled_model):
    requests = mixed_requests(64)
    want = solo_outputs(bundled_model, requests)

    async def concurrent():
        link = await SwarmLink.open(local_swarm.asker_home, alive_check=local_swarm.check_alive, min_stages=2)
        asker = Asker(bundled_model, link.head_layers, n_threads=N_THREADS, max_in_flight=64)
        try:
            try:
                gens = await asyncio.wait_for(asyncio.gather(*[
                    generate_all(asker, p, link, max_tokens=m, sampling=GREEDY) for p, m in requests]), 300)
            except asyncio.TimeoutError:
                raise AssertionError(f"64 requests did not finish in 300 s; the nodes' logs:\n"
                                     f"{local_swarm.log_tails()}") from None
            stats = await settled_stats(local_swarm, link)
            idle = (asker.head.n_requests, asker.tail.n_requests, asker.head.kv_bytes + asker.tail.kv_bytes)
            await link.close()
            streams = await settled_stream_counts(local_swarm, link)
            return gens, stats, idle, streams
        finally:
            await link.close()
            asker.close()

    gens, stats, idle, streams = asyncio.run(concurrent())
    for i, (gen, expected) in enumerate(zip(gens, want)):
        assert gen.tokens == expected, f"request {i} differs from its solo run"
    assert max(s["largest_batch"] for s in stats) > 1  # the stages really batched
    batched_hops = [h.batch for g in gens for t in g.timings if t.trunk for h in t.trunk.hops]
    assert max(batched_hops) > 1
    for s in stats:
        assert _idle(s), s  # back to idle
    assert idle == (0, 0, 0)
    # Every request's streams ended on both sides (else QUIC's stream limit runs out and the link
    # between the stages stalls): what is left is the plan stream from the host and the stats query.
    assert all(n <= 3 for n in streams), streams


def test_interleaved_requests_never_mix_caches(local_swarm, bundled_model):
    """Prompts identical but for their last token, generated concurrently."""
    prefix = [int(t) for t in np.random.default_rng(9).integers(100, 40000, 40)]
    requests = [(prefix + [last], 12) for last in (1000, 2000, 3000, 4000)]
    want = solo_outputs(bundled_model, requests)
    assert len({tuple(w) for w in want}) > 1  # the last token matters

    async def concurrent():
        link = await SwarmLink.open(local_swarm.asker_home, min_stages=2)
        asker = Asker(bundled_model, link.head_layers, n_threads=N_THREADS)
        try:
            return await asyncio.gather(*[generate_all(asker, p, link, max_tokens=m, sampling=GREEDY)
                                          for p, m in requests])
        finally:
            await link.close()
            asker.close()

    assert [g.tokens for g in asyncio.run(concurrent())] == want


BUSY_TOKENS = 160


def test_admission_waits_then_times_out_with_a_clear_error(local_swarm, bundled_model):
    async def scenario():
        link = await SwarmLink.open(local_swarm.asker_home, min_stages=2)
        asker = Asker(bundled_model, link.head_layers, n_threads=N_THREADS, max_in_flight=2)
        prompt = [int(t) for t in range(200, 230)]
        try:
            # Busy for longer than the 0.3 + 1 s below on any machine: with 40 tokens each (and EOS
            # allowed), a quiet box finished both within that, and the third request was let in
            # and then ran past its own 1 s deadline instead.
            busy = [asyncio.ensure_future(generate_all(asker, prompt, link, max_tokens=BUSY_TOKENS,
                                                       sampling=GREEDY, ignore_eos=True))
                    for _ in range(2)]
            await asyncio.sleep(0.3)
            assert len(asker.in_flight) == 2
            with pytest.raises(BusyError, match="busy .2 requests in flight.; gave up after waiting 1s"):
                await generate_all(asker, prompt, link, max_tokens=4, sampling=GREEDY, timeout=1.0)
            waited = asyncio.ensure_future(generate_all(asker, prompt, link, max_tokens=4, sampling=GREEDY,
                                                        timeout=120))
            done = await asyncio.gather(*busy, waited)
            return [len(g.tokens) for g in done]
        finally:
            await link.close()
            asker.close()

    assert asyncio.run(scenario()) == [BUSY_TOKENS, BUSY_TOKENS, 4]  # the waiting request ran once a slot freed


def test_one_link_serves_more_requests_than_quic_has_streams(local_swarm, bundled_model):
    """Each request has its own stream on every hop; QUIC (aioquic) grants a peer 128 at a time
    and more only as streams finish both ways. So both ends must finish a request's stream when
    it is released, or the 129th request through one link waits forever."""
    async def many():
        link = await SwarmLink.open(local_swarm.asker_home, min_stages=2)
        link.request_timeout = 20
        asker = Asker(bundled_model, link.head_layers, n_threads=N_THREADS)
        try:
            return [len((await generate_all(asker, [1000 + i], link, max_tokens=1, sampling=GREEDY)).tokens)
                    for i in range(140)]
        finally:
            await link.close()
            asker.close()

    assert asyncio.run(many()) == [1] * 140


SPECULATION_PROMPTS = [
    # drafts mostly kept: the answer repeats the prompt
    "Repeat this code exactly, with x renamed to y:\ndef area(x):\n    return 3.14159 * x * x\n",
    # drafts mostly rejected: little in the answer repeats the prompt
    "Write a two-sentence story about a lighthouse keeper and a whale.",
    "Count from 1 to 15, separated by commas.",
]


def test_speculative_steps_through_the_swarm_keep_every_greedy_token(local_swarm, bundled_model):
    """ngram and draft speculation (the bundled model drafting for itself) through 2 trunk
    processes, concurrently with plain requests so that checks share batches, one window per
    round trip and three (ngram) and six (draft) windows in flight: every request's tokens equal its plain greedy run,
    drafts were both kept and rejected (rewinds happened, windows out fell), and every stage is
    idle afterwards (no cells held for a window that fell)."""
    from swarmctl.asker.speculate import ModelDraft, speculation_for

    async def scenario():
        link = await SwarmLink.open(local_swarm.asker_home, alive_check=local_swarm.check_alive, min_stages=2)
        asker = Asker(bundled_model, link.head_layers, n_threads=N_THREADS, max_in_flight=32)
        draft = ModelDraft(bundled_model, asker.gguf, n_threads=N_THREADS)
        try:
            prompts = [asker.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in SPECULATION_PROMPTS]
            modes = {"off": ("off", None), "ngram": ("ngram", None), "draft": ("draft", None),
                     "ngram_3_windows": ("ngram", 3), "draft_6_windows": ("draft", 6)}
            runs = [(mode, p) for mode in modes for p in range(len(prompts))]
            gens = await asyncio.wait_for(asyncio.gather(*[
                generate_all(asker, prompts[p], link, max_tokens=40, sampling=GREEDY,
                             speculation=speculation_for(modes[mode][0], draft, k_max=6, windows=modes[mode][1]))
                for mode, p in runs]), 300)
            stats = await settled_stats(local_swarm, link)
            return dict(zip(runs, gens)), stats, link.stats.most_steps_out
        finally:
            await link.close()
            draft.close()
            asker.close()

    gens, stats, most_steps_out = asyncio.run(scenario())
    for (mode, p), gen in gens.items():
        assert gen.tokens == gens["off", p].tokens, f"{mode} speculation changed the answer to prompt {p}"
    assert most_steps_out >= 2  # windows were out together
    windows = [gens["ngram_3_windows", p] for p in range(len(SPECULATION_PROMPTS))]
    assert windows[0].accepted >= 10 and len(windows[0].timings) < len(windows[0].tokens)
    assert any(g.drafted > g.accepted for g in windows)  # windows fell too
    ngram = [gens["ngram", p] for p in range(len(SPECULATION_PROMPTS))]
    assert ngram[0].accepted >= 10  # the repeated code was drafted and kept
    assert ngram[0].drafted > ngram[0].accepted or ngram[1].drafted > ngram[1].accepted  # and some drafts failed
    assert len(ngram[0].timings) < len(ngram[0].tokens)  # fewer trips than tokens
    for p in range(len(SPECULATION_PROMPTS)):
        d = gens["draft", p]
        assert d.accepted == d.drafted > 0  # the model drafting for itself is always right
        assert len(d.timings) <= len(d.tokens) // 2
    for s in stats:
        assert _idle(s), s


def long_prompt(n: int, seed: int = 21) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, 40000, n)]


def test_a_long_prompt_streams_its_chunks_through_the_stages_and_survives_a_broken_route(
        local_swarm, bundled_model, monkeypatch):
    """280 prompt tokens are three chunks of a step each (128, 128, 24; an asker's chunk is 512 by
    default, lowered here so that the prompts cost less: the code path is the same): the link has them out
    together, and the tokens are those of one chunk at a time in one process. Then the same prompt
    again, with the first stage's connection closed under it while chunks are out: the link
    reroutes, replays what was answered and sends the chunks out again in order, and the tokens
    are the same again; the stages end idle."""
    policy = ReroutePolicy(same_route_retry_s=0.5)  # (a dropped link, same plan: retried after this)
    chunk = 128
    prompt = long_prompt(280)
    want = solo_outputs(bundled_model, [(prompt, 6)], prefill_chunk=chunk)[0]

    async def scenario():
        link = await SwarmLink.open(local_swarm.asker_home, alive_check=local_swarm.check_alive, min_stages=2,
                                    policy=policy)
        asker = Asker(bundled_model, link.head_layers, n_threads=N_THREADS, prefill_chunk=chunk)
        try:
            streamed = await generate_all(asker, prompt, link, max_tokens=6, sampling=GREEDY)
            most_out = link.stats.most_steps_out
            broken = asyncio.get_running_loop().create_future()

            class BreaksMidPrompt:  # the link, with its first stage's connection closed once chunks are out
                steps_in_flight = link.steps_in_flight

                async def forward(self, rid, hidden, start_pos, **kwargs):
                    if start_pos == chunk and not broken.done():
                        asyncio.get_running_loop().call_soon(link.first_conn.close)
                        broken.set_result(None)
                    return await link.forward(rid, hidden, start_pos, **kwargs)

                async def release(self, rid):
                    await link.release(rid)

            recovered = await generate_all(asker, prompt, BreaksMidPrompt(), max_tokens=6, sampling=GREEDY)
            return streamed, most_out, recovered, link.stats.recoveries, await settled_stats(local_swarm, link)
        finally:
            await link.close()
            asker.close()

    streamed, most_out, recovered, recoveries, stats = asyncio.run(scenario())
    assert streamed.tokens == want
    assert len(streamed.fill_timings) == 2 and most_out >= 2  # the chunks were out together
    assert recoveries >= 1 and recovered.tokens == want
    for s in stats:
        assert _idle(s), {k: s[k] for k in ("name", "requests", "kv_bytes", "routes")}


def test_a_step_whose_answer_never_comes_is_resent_on_a_fresh_route(local_swarm, bundled_model, monkeypatch):
    """The stages answer pings but one decode step's result is lost on the way back (dropped here
    as it arrives: nothing in the swarm does that on purpose, which is why it is faked). The link
    resends that request on a fresh route after its stall limit (lowered from 30 s to 1 s), replays
    its history, and the tokens are those of a solo run; the stages end idle."""
    from net.wire import FrameType, PacketKind, decode_packet

    prompt = long_prompt(40, seed=22)
    want = solo_outputs(bundled_model, [(prompt, 8)])[0]

    async def scenario():
        link = await SwarmLink.open(local_swarm.asker_home, alive_check=local_swarm.check_alive, min_stages=2,
                                    request_timeout=60,  # (without the resend: SwarmError after this)
                                    policy=ReroutePolicy(same_route_retry_s=0.5, stall_min_s=1.0))
        asker = Asker(bundled_model, link.head_layers, n_threads=N_THREADS)
        dropped: list[int] = []
        deliver = link.frame_received

        def loses_one_result(conn, stream_id, frame):
            if frame.type == FrameType.ACTIVATION and not dropped:
                packet = decode_packet(frame.body)
                if packet.kind == PacketKind.RESULT and packet.start_pos == len(prompt) + 2:
                    dropped.append(packet.start_pos)
                    return
            deliver(conn, stream_id, frame)

        link.frame_received = loses_one_result  # (the connections call their handler's method by name)
        try:
            got = await generate_all(asker, prompt, link, max_tokens=8, sampling=GREEDY)
            return got, dropped, link.stats.stalls, await settled_stats(local_swarm, link)
        finally:
            await link.close()
            asker.close()

    got, dropped, stalls, stats = asyncio.run(scenario())
    assert dropped == [len(prompt) + 2]  # the fault happened
    assert stalls == 1 and got.tokens == want
    for s in stats:
        assert _idle(s), {k: s[k] for k in ("name", "requests", "kv_bytes", "routes")}


def test_a_route_that_cannot_be_reached_again_fails_with_a_clear_error_by_the_deadline(
        local_swarm, bundled_model, monkeypatch):
    """The first stage's connection drops and no new connection can be made (the dialer refuses,
    faked here: the swarm itself stays up for the other tests). The request keeps trying within its
    deadline (3 s here, a retry every 0.5 s) and then fails with SwarmError saying why, not with the
    link's internal exception, and the link does not hang."""
    from swarmctl.asker.plan_watch import SwarmError


    async def scenario():
        link = await SwarmLink.open(local_swarm.asker_home, alive_check=local_swarm.check_alive, min_stages=2,
                                    request_timeout=3, policy=ReroutePolicy(same_route_retry_s=0.5))
        asker = Asker(bundled_model, link.head_layers, n_threads=N_THREADS)

        async def unreachable(member, address, handler):
            raise ConnectionError(f"{member} does not answer (faked)")

        try:
            link.dialer.connect = unreachable
            link.first_conn.close()
            with pytest.raises(SwarmError, match="kept failing, last: .*does not answer"):
                await asyncio.wait_for(generate_all(asker, long_prompt(20), link, max_tokens=2, sampling=GREEDY), 60)
        finally:
            await link.close()
            asker.close()

    asyncio.run(scenario())

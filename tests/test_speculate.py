"""Speculative steps (issue 18): draft sources, draft length, exact checks, rewinds, speculative
sampling's distribution, and a draft with another vocabulary refused. The greedy identity through a
real swarm is in tests/test_pipelining.py (it shares that file's local swarm)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kernels.errors import EngineError, RequestStateError
from kernels.gguf_file import GGUFFile
from kernels.sampling import SamplingParams
from kernels.slice import SliceEngine, Step
from kernels.spec import ModelSpec, SliceSpec
from net.wire import ActivationPacket, FrameDecoder, PacketKind, decode_packet, encode_packet
from swarmctl.asker.head_tail import Asker, InprocTrunk, generate_all, u_split
from swarmctl.asker.speculate import (MAX_WINDOWS, Draft, DraftLength, ModelDraft, NgramDraft, open_drafting,
                                      speculation_for)
from tests.conftest import N_THREADS
from harness.swarm import swarmctl
from harness.tiny_models import TinyConfig, write_tiny_model


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    draft = NgramDraft(max_ngram=3)
    assert draft.propose([1, 2, 3, 9, 9, 1, 2, 3], 3) == [9, 9, 1]  # the 3-gram [1, 2, 3] came before
    assert draft.propose([5, 1, 2, 7, 1, 2, 8, 1, 2], 2) == [8, 1]  # the latest earlier occurrence wins
    assert draft.propose([4, 5, 6], 4) == []  # nothing repeats
    assert draft.propose([1, 2, 1], 0) == []
    assert draft.propose([7, 3, 7], 5) == [3, 7]  # as much as there is


def test_draft_length_follows_acceptance_and_what_a_row_costs():
    """Over a WAN (a row costs 5 % of a step) drafts pay even when half fail; on one machine (a row
    costs as much as a step) the same acceptance means plain steps, with a single draft retried
    after retry_after of them; drafts that keep failing bring k down everywhere."""
    wan, local = DraftLength(k=4, k_max=8, retry_after=3), DraftLength(k=4, k_max=8, retry_after=3)
    for length, compute_s, total_s in ((wan, 0.010, 0.080), (local, 0.010, 0.011)):
        length.observe(1, compute_s, total_s)  # a plain step
        length.observe(5, compute_s * 5, total_s + compute_s * 4)  # four more rows, each as costly
        for _ in range(4):
            length.update(4, 2)  # half the drafts kept
    assert wan.rho < 0.2 and local.rho > 0.8
    assert wan.k >= 3
    assert local.k == 0
    assert [local.next() for _ in range(3)] == [0, 0, 1]  # plain steps, then one draft to try again
    for _ in range(12):
        wan.update(max(wan.k, 1), 0)  # nothing kept, again and again
    assert wan.k == 0
    for _ in range(6):
        wan.update(4, 4)  # and all kept: back up
    assert wan.k == 8
    with pytest.raises(EngineError, match="--speculate 'magic'"):
        speculation_for("magic")


def test_windows_in_flight_follow_whole_windows_kept_the_trip_and_the_stages_load():
    """Several windows out only where the trip holds them (over a WAN, not on one machine), while
    whole windows are mostly kept, and fewer while the stages queue other requests' steps."""
    def length_after(compute_s, total_s, queued_s, kept_all: int, of: int) -> DraftLength:
        length = DraftLength(k=4, k_max=8)
        length.observe(1, compute_s, total_s, queued_s)
        length.observe(5, compute_s * 1.2, total_s, queued_s)
        for i in range(of):
            length.update(4, 4 if i < kept_all else 1)
        return length

    copying_over_wan = length_after(0.010, 0.080, 0.0, kept_all=9, of=10)
    assert copying_over_wan.windows() == MAX_WINDOWS
    assert length_after(0.010, 0.011, 0.0, kept_all=9, of=10).windows() == 1  # one machine: nothing to overlap
    assert length_after(0.010, 0.080, 0.0, kept_all=0, of=10).windows() == 1  # windows keep falling
    # whole windows kept 60 % of the time: an idle swarm takes the chance, a busy one less so
    idle = length_after(0.010, 0.080, 0.0, kept_all=6, of=10)
    busy = length_after(0.010, 0.080, 0.030, kept_all=6, of=10)
    assert idle.windows() > busy.windows() >= 1
    assert DraftLength(k=4, fixed_windows=3).windows() == 3


@pytest.fixture(scope="module")
def whole_engine(bundled_model):
    gguf = GGUFFile(bundled_model)
    engine = SliceEngine(gguf, SliceSpec(0, ModelSpec.from_gguf(gguf).n_layer, True, True), n_threads=N_THREADS)
    yield engine
    engine.close()
    gguf.close()


def _single_steps(engine, rid, prompt, n):
    """Greedy tokens one step at a time after the prompt, and each step's logits."""
    logits = engine.forward(rid, start_pos=0, tokens=prompt)
    tokens, rows = [int(np.argmax(logits[-1]))], []
    for i in range(n):
        row = engine.forward(rid, start_pos=len(prompt) + i, tokens=[tokens[-1]])[-1]
        rows.append(row.copy())
        tokens.append(int(np.argmax(row)))
    engine.release(rid)
    return tokens, np.array(rows)


@pytest.mark.slow  # the whole bundled model, step by step: 5 s
def test_a_checked_step_gives_each_row_the_bits_of_single_steps(whole_engine, bundled_model):
    """A step of 8 positions marked verify equals 8 one-token steps bit for bit (a plain step of 8
    need not: its attention products are summed in another order; swarmctl/asker/speculate.py)."""
    from kernels.tokenizer import Tokenizer

    text = Tokenizer(bundled_model).encode_prompt("Once upon a time, in a land far away, a dragon read books. " * 8)
    plain_differs = 0
    for n_prompt in (30, 60, 97):
        prompt = text[:n_prompt]
        tokens, single = _single_steps(whole_engine, "single", prompt, 8)
        for verify in (True, False):
            whole_engine.forward("multi", start_pos=0, tokens=prompt)
            multi = whole_engine.forward_batch([Step("multi", n_prompt, tokens=tokens[:8], outputs="all",
                                                     verify=verify)])[0]
            whole_engine.release("multi")
            if verify:
                assert np.array_equal(multi, single), f"prompt of {n_prompt}: a checked row differs"
            else:
                plain_differs += sum(not np.array_equal(a, b) for a, b in zip(multi, single))
    print(f"rows of a plain 8-row step that differ from single steps: {plain_differs} of 24")


def test_rejected_positions_never_influence_later_tokens(whole_engine):
    """Drafts that were rejected leave cells behind; a rewind drops them: what follows is the bits of
    a request that never saw them. A step that would drop cells without saying rewind is refused."""
    prompt = list(range(300, 340))
    x, y = 1000, 2000
    whole_engine.forward("a", start_pos=0, tokens=prompt)
    whole_engine.forward_batch([Step("a", 40, tokens=[x, 7, 8, 9, 10], outputs="all", verify=True)])
    with pytest.raises(RequestStateError, match="does not say rewind"):
        whole_engine.forward("a", start_pos=41, tokens=[y])
    got = whole_engine.forward_batch([Step("a", 41, tokens=[y, 5], outputs="all", rewind=True, verify=True)])[0]
    whole_engine.forward("b", start_pos=0, tokens=prompt)
    whole_engine.forward("b", start_pos=40, tokens=[x])
    want = [whole_engine.forward("b", start_pos=41, tokens=[y])[-1], whole_engine.forward("b", start_pos=42, tokens=[5])[-1]]
    for rid in ("a", "b"):
        whole_engine.release(rid)
    assert np.array_equal(got, np.array(want))


def test_rewind_and_verify_cross_the_wire():
    data = np.ones((3, 8), np.float32)
    for rewind in (False, True):
        for verify in (False, True):
            packet = ActivationPacket(PacketKind.PREFILL, b"r" * 16, 1, 4, 40, data, rewind=rewind, verify=verify)
            (frame,) = FrameDecoder().feed(encode_packet(packet))
            back = decode_packet(frame.body)
            assert (back.rewind, back.verify) == (rewind, verify)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, bundled_model):
    """A tiny target and a tiny draft (the same random weights, quantized coarser), same vocabulary:
    the draft is sometimes right."""
    folder = tmp_path_factory.mktemp("spec-models")
    target = write_tiny_model(folder / "target.gguf", TinyConfig(qtype="Q8_0", seed=11), bundled_model)
    draft = write_tiny_model(folder / "draft.gguf", TinyConfig(qtype="Q4_0", seed=11), bundled_model)
    return target, draft


RUNS = 1200


@pytest.mark.slow  # thousands of sampled steps: 15-20 s each
@pytest.mark.parametrize("windows", [None, 2], ids=["one_window", "two_windows_in_flight"])
def test_speculative_sampling_keeps_the_target_distribution(tiny_pair, windows):
    """Chi-square: the first three sampled tokens (top-k 3, temperature 1; the second and third come
    from checked drafts) of many seeded runs with a draft model that is sometimes wrong, against the
    target's exact joint distribution computed from its logits; and the statistic has the power to
    tell a distribution that is off. With two windows in flight, one draft each: the second
    window's first token is the guess of the third token, checked by the first window's last row,
    and sent before that verdict (issue 34)."""
    target_path, draft_path = tiny_pair
    sampling = dict(temperature=1.0, top_k=3, top_p=1.0)
    asker = Asker(target_path, 1, n_threads=N_THREADS)
    trunk = InprocTrunk(asker.gguf, u_split(asker.spec.n_layer, 1, 1).trunk, n_threads=N_THREADS,
                        max_context=asker.max_context)
    draft = ModelDraft(draft_path, asker.gguf, n_threads=N_THREADS)
    prompt = [400, 401, 402, 403]
    try:
        exact = _exact_joint(target_path, prompt, SamplingParams(**sampling))

        async def runs(n, spec_mode):
            counts, kept, in_flight, stood = {}, 0, 0, 0
            for seed in range(n):
                spec = speculation_for(spec_mode, draft, k_max=2 if windows is None else 1, windows=windows)
                g = await generate_all(asker, prompt, trunk, max_tokens=3 if windows is None else 4, ignore_eos=True,
                                       sampling=SamplingParams(**sampling, seed=seed), speculation=spec)
                counts[tuple(g.tokens[:3])] = counts.get(tuple(g.tokens[:3]), 0) + 1
                kept += g.accepted
                # (a fourth token, so that a second window can go out: the first checks its draft and
                # the second's guess of the third token, which is what is counted)
                in_flight += g.timings[1].drafted == 2
                stood += g.timings[1].kept == 2
            return counts, kept, in_flight, stood

        counts, kept, in_flight, stood = asyncio.run(runs(RUNS, "draft"))
    finally:
        draft.close()
        trunk.close()
        asker.close()
    assert set(counts) <= set(exact), "a sequence the target cannot produce"
    # Sequences the target makes rarely are pooled into one cell, so that every cell expects >= 5.
    cells = sorted(exact, key=exact.get, reverse=True)
    common = [c for c in cells if exact[c] * RUNS >= 5]
    observed = np.array([counts.get(c, 0) for c in common] + [sum(counts.get(c, 0) for c in cells[len(common):])])
    expected = np.array([exact[c] for c in common] + [sum(exact[c] for c in cells[len(common):])]) * RUNS
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    cells = common
    limit = _chi2_critical(len(cells) - 1)
    assert 0 < kept < RUNS * 2, "the draft was never or always right: the residual path was not exercised"
    if windows is not None:  # the second window went out early in every run, and stood in some, fell in others
        assert in_flight == RUNS and 0 < stood < RUNS
    print(f"speculative sampling: {RUNS} runs, {kept} drafts kept, chi2 {_chi2(observed, expected):.1f} "
          f"over {len(observed)} cells (limit {limit:.1f})")
    assert _chi2(observed, expected) < limit, \
        f"speculative samples do not follow the target: {dict(zip(cells, observed))} vs {dict(zip(cells, expected))}"
    # The test has power: the same counts against the target's distribution with its likeliest and
    # least likely pair of tokens swapped fail it.
    swapped = expected.copy()
    hi, lo = int(np.argmax(expected)), int(np.argmin(expected))
    swapped[hi], swapped[lo] = expected[lo], expected[hi]
    assert _chi2(observed, swapped) > limit


def _chi2(observed: np.ndarray, expected: np.ndarray) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square statistic's 0.999 quantile (Wilson-Hilferty; z of 0.999 = 3.09): a true
    distribution fails this test one time in a thousand."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _exact_joint(path, prompt, params: SamplingParams, depth: int = 3) -> dict[tuple[int, ...], float]:
    """P(first ``depth`` tokens) under the model and the sampler's top-k/temperature, from its logits."""
    from kernels.sampling import Sampler

    sampler = Sampler(params)
    with GGUFFile(path) as gguf:
        engine = SliceEngine(gguf, SliceSpec(0, ModelSpec.from_gguf(gguf).n_layer, True, True), n_threads=N_THREADS)
        try:
            joint = {(): 1.0}
            for _ in range(depth):
                longer = {}
                for seq, p_seq in joint.items():
                    nxt = sampler.candidates(engine.forward("p", start_pos=0, tokens=list(prompt) + list(seq))[-1])
                    engine.release("p")
                    for t, p_t in zip(nxt.ids.tolist(), nxt.probs.tolist()):
                        longer[seq + (t,)] = p_seq * p_t
                joint = longer
        finally:
            engine.close()
    return joint


def test_a_draft_with_another_vocabulary_is_refused_in_one_line(tmp_path, bundled_model, tiny_pair):
    other = write_tiny_model(tmp_path / "other-vocab.gguf", TinyConfig(qtype="Q8_0", vocab_limit=1000), bundled_model)
    with pytest.raises(EngineError, match="vocabulary differs"):
        open_drafting("draft", str(other), tiny_pair[0])
    result = swarmctl(None, "ask", "--transport", "inproc", "--model", str(tiny_pair[0]), "--head-layers", "1",
                      "--speculate", "draft", "--draft-model", str(other), "hi")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "vocabulary differs from the model's (1000 tokens vs 49152)" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    drafting = open_drafting("draft", str(tiny_pair[1]), tiny_pair[0])  # same vocabulary: accepted
    drafting.close()


def test_a_draft_only_proposes_within_the_context_left(tiny_pair):
    target, draft_path = tiny_pair
    with GGUFFile(target) as gguf:
        draft = ModelDraft(draft_path, gguf, n_threads=N_THREADS, max_context=16)
    try:
        out = asyncio.run(draft.draft(b"r", list(range(500, 514)), 8, SamplingParams(temperature=0)))
        assert len(out.tokens) == 2 and isinstance(out, Draft)
    finally:
        draft.close()


def test_layerskip_drafts_with_the_askers_own_ends_and_greedy_output_is_unchanged(bundled_model):
    """--speculate layerskip: the model's head layers feed its tail layers and LM head directly (the
    trunk skipped) as the draft. Greedy answers equal plain decoding token for token, and some
    drafts go through the checked path (how many are kept is measured, not asserted: on SmolLM2 with
    K = 4 of 30 layers almost none are; docs/speculation.md has the figures)."""
    from swarmctl.asker.speculate import LayerSkipDraft

    asker, trunk = asker_and_trunk(bundled_model, 4, stages=2, max_context=512)
    draft = LayerSkipDraft(bundled_model, 4, n_threads=N_THREADS, max_context=512)
    prompt = asker.tokenizer.encode_chat([{"role": "user", "content": "Count from one to twenty in words."}])
    try:
        async def both():
            plain = await generate_all(asker, prompt, trunk, max_tokens=40, sampling=SamplingParams(temperature=0))
            spec = await generate_all(asker, prompt, trunk, max_tokens=40, sampling=SamplingParams(temperature=0),
                                      speculation=speculation_for("layerskip", draft))
            return plain, spec

        plain, spec = asyncio.run(both())
    finally:
        draft.close()
        trunk.close()
        asker.close()
    assert spec.tokens == plain.tokens
    assert spec.drafted > 0
    print(f"layerskip on SmolLM2 (K=4, counting): {spec.accepted} of {spec.drafted} drafts kept")
    with pytest.raises(EngineError, match="head layers do not fit"):
        LayerSkipDraft(bundled_model, 20)


def asker_and_trunk(path, head_layers: int, *, stages: int, max_context: int) -> tuple[Asker, InprocTrunk]:
    """An asker keeping ``head_layers`` at each end and the trunk between in ``stages`` in-process
    stages (the caller closes both)."""
    asker = Asker(path, head_layers, n_threads=N_THREADS, max_context=max_context)
    trunk = InprocTrunk(asker.gguf, u_split(asker.spec.n_layer, head_layers, stages).trunk, n_threads=N_THREADS,
                        max_context=asker.max_context)
    return asker, trunk


def test_a_tail_returns_every_rows_hidden_state_without_changing_its_logits(tiny_model):
    """Step.hidden_rows (what --speculate mtp drafts from): the logits are the bits a plain step
    gives, and a prompt step that keeps one row of logits still returns every row's final hidden
    state, the same bits a step keeping every row gives (the last layer's FFN runs on every row
    beside the kept one). Also for a tail that is the LM head alone (--head-layers 0)."""
    from kernels.slice import WithHidden

    path = tiny_model("deepseek2-mtp-q4_1")
    with GGUFFile(path) as gguf:
        spec = ModelSpec.from_gguf(gguf)
        n = spec.n_layer
        head = SliceEngine(gguf, SliceSpec(0, n - 1, has_embedding=True), n_threads=N_THREADS, max_context=64)
        rows = head.forward("h", start_pos=0, tokens=list(range(40, 60)))
        for tail_spec in (SliceSpec(n - 1, n, has_lm_head=True), SliceSpec(n, n, has_lm_head=True)):
            x = rows if tail_spec.start < n else head_and_layer(gguf, n, rows)
            with SliceEngine(gguf, tail_spec, n_threads=N_THREADS, max_context=64) as tail:
                plain, last, every = tail.forward_batch([Step("a", 0, hidden=x), Step("b", 0, hidden=x, hidden_rows=True),
                                                         Step("c", 0, hidden=x, outputs="all", hidden_rows=True)])
                assert isinstance(last, WithHidden) and isinstance(every, WithHidden)
                assert np.array_equal(plain, last.rows) and last.rows.shape == (1, plain.shape[1])
                assert last.hidden.shape == (20, spec.n_embd) and np.array_equal(last.hidden, every.hidden)
                assert np.isfinite(last.hidden).all() and not np.array_equal(last.hidden[0], last.hidden[1])
        head.close()


def head_and_layer(gguf, n, rows):
    """The input of an LM-head-only tail: the rows through the model's last layer too."""
    with SliceEngine(gguf, SliceSpec(n - 1, n), n_threads=N_THREADS, max_context=64) as last:
        return last.forward("x", start_pos=0, hidden=rows)


def test_mtp_drafts_with_the_models_nextn_layer_and_greedy_output_is_unchanged(tiny_model, bundled_model):
    """--speculate mtp on a tiny DeepSeek-V3 whose file carries a nextn layer: the layer runs at the
    asker from the tail's hidden states. Greedy answers equal plain decoding (one window, and three
    windows in flight, which chain through guessed tokens), the nextn layer keeps nothing once a
    request ends, and the main model is the one without the layer (same tokens). How many drafts
    are kept is printed, not asserted: the tiny model's nextn layer is random. A file without a
    nextn layer is a one-line refusal."""
    from swarmctl.asker.speculate import MtpDraft

    path = tiny_model("deepseek2-mtp-q4_1")
    asker, trunk = asker_and_trunk(path, 1, stages=2, max_context=256)
    without = Asker(tiny_model("deepseek2-q4_1"), 2, n_threads=N_THREADS, max_context=256)  # every layer
    draft = MtpDraft(path, n_threads=N_THREADS, max_context=256)
    prompt = asker.tokenizer.encode_chat([{"role": "user", "content": "Write the numbers one to ten."}])
    greedy = SamplingParams(temperature=0)
    try:
        async def runs():
            plain = await generate_all(asker, prompt, trunk, max_tokens=40, sampling=greedy, ignore_eos=True)
            other = await generate_all(without, prompt, None, max_tokens=40, sampling=greedy, ignore_eos=True)
            one = await generate_all(asker, prompt, trunk, max_tokens=40, sampling=greedy, ignore_eos=True,
                                     speculation=speculation_for("mtp", draft))
            three = await generate_all(asker, prompt, trunk, max_tokens=40, sampling=greedy, ignore_eos=True,
                                       speculation=speculation_for("mtp", draft, windows=3))
            return plain, other, one, three

        plain, other, one, three = asyncio.run(runs())
        held = draft.engine.n_requests
    finally:
        draft.close()
        trunk.close()
        asker.close()
        without.close()
    assert len(plain.tokens) == 40
    assert one.tokens == plain.tokens and three.tokens == plain.tokens
    assert one.drafted > 0 and three.drafted > 0
    assert held == 0
    # (an asker holding every layer of the file without it: the same model)
    assert other.tokens == plain.tokens
    print(f"mtp on the tiny deepseek2: one window {one.accepted}/{one.drafted} kept, "
          f"three windows {three.accepted}/{three.drafted}")
    result = swarmctl(None, "ask", "--transport", "inproc", "--model", str(tiny_model("deepseek2-q4_1")),
                      "--head-layers", "1", "--speculate", "mtp", "hi")
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert "has no multi-token-prediction (nextn) layer" in lines[0] and "Traceback" not in result.stderr


def test_mtp_drafts_are_kept_when_the_nextn_layer_knows_the_next_token(tiny_model):
    """A wiring check: a tiny model that after each token says a fixed other one, with a nextn
    layer built to predict exactly that from the token it is given (harness/tiny_models._echo).
    Its drafts are kept only if every position gets the right token and hidden state, the prompt's
    catch-up, the chain through drafted tokens and windows in flight included; an off-by-one
    anywhere keeps next to none. Greedy answers equal plain decoding."""
    from swarmctl.asker.speculate import MtpDraft

    path = tiny_model("deepseek2-echo-f32")
    asker, trunk = asker_and_trunk(path, 1, stages=1, max_context=256)
    draft = MtpDraft(path, n_threads=N_THREADS, max_context=256)
    prompt = asker.tokenizer.encode_prompt("The numbers go on and on")
    greedy = SamplingParams(temperature=0)
    try:
        async def runs():
            plain = await generate_all(asker, prompt, trunk, max_tokens=30, sampling=greedy, ignore_eos=True)
            specs = [await generate_all(asker, prompt, trunk, max_tokens=30, sampling=greedy, ignore_eos=True,
                                        speculation=speculation_for("mtp", draft, windows=w)) for w in (1, 3)]
            return plain, specs

        plain, specs = asyncio.run(runs())
    finally:
        draft.close()
        trunk.close()
        asker.close()
    assert len(set(plain.tokens)) > 20  # (it does not repeat itself: a token's successor is its own)
    for spec in specs:
        assert spec.tokens == plain.tokens
        print(f"mtp on the echo model: {spec.accepted} of {spec.drafted} drafts kept")
        assert spec.accepted >= 0.9 * spec.drafted and spec.drafted >= 20, (spec.accepted, spec.drafted)


def test_windows_in_flight_stop_at_the_context(tiny_model):
    """Windows asked for beyond the context: a repetitive prompt a few tokens short of the context,
    ngram with four windows always in flight, an echo model (harness/tiny_models._echo) with mtp
    too: each request ends with finish "context", the same tokens as plain decoding, no step past
    the last position, and nothing left held at the draft's layer."""
    from swarmctl.asker.speculate import MtpDraft

    path = tiny_model("deepseek2-echo-f32")
    asker, trunk = asker_and_trunk(path, 1, stages=1, max_context=48)
    draft = MtpDraft(path, n_threads=N_THREADS, max_context=48)
    greedy = SamplingParams(temperature=0)
    try:
        async def runs():
            # a prompt whose end repeats what the model says after token 300, so ngram drafts it
            said = (await generate_all(asker, [300], trunk, max_tokens=29, sampling=greedy, ignore_eos=True)).tokens
            prompt = [300, *said, 300, *said[:10]]  # 41 of 48 positions
            plain = await generate_all(asker, prompt, trunk, max_tokens=30, sampling=greedy, ignore_eos=True)
            spec = [await generate_all(asker, prompt, trunk, max_tokens=30, sampling=greedy, ignore_eos=True,
                                       speculation=speculation_for(mode, draft, windows=4)) for mode in ("ngram", "mtp")]
            return plain, spec

        plain, spec = asyncio.run(runs())
        held = draft.engine.n_requests
    finally:
        draft.close()
        trunk.close()
        asker.close()
    assert plain.finish_reason == "context" and len(plain.tokens) == 48 - 41 + 1  # (the last one is never fed)
    for gen in spec:
        assert gen.finish_reason == "context" and gen.tokens == plain.tokens
        assert max(t.start_pos + t.rows for t in gen.timings) <= 48
    assert spec[0].drafted > 0 and spec[1].drafted > 0 and held == 0

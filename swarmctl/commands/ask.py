"""Ask the model and stream its answer to stdout.

With a swarm joined (a node home in $SWARMCTL_HOME), the trunk of the model runs on the swarm.
With none, a local swarm starts for this one question: a host and --trunk-nodes trunk
processes on loopback, with real QUIC and mutual TLS, shut down afterwards.
--transport inproc runs every slice inside this process instead.

examples:
  swarmctl ask "What is the capital of France?"
  swarmctl ask --raw --temperature 0 --max-tokens 32 "The three primary colours are"
  swarmctl ask --model ~/models/llama-3-8b.Q4_K_M.gguf --head-layers 2 --stages 3 "Hi"
  swarmctl ask --trace trace.json "Hi"     (then open trace.json in ui.perfetto.dev)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path

from kernels.sampling import SamplingParams
from swarmctl.commands.options import add_asker_options, add_sampling_options, sampling_params, session_options
from swarmctl.errors import UsageError

log = logging.getLogger("swarmctl.ask")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the question (or, with --raw, the text to continue)")
    add_asker_options(parser, model_default="the bundled SmolLM2-135M-Instruct")
    add_sampling_options(parser, max_tokens=256, max_tokens_help="tokens to generate")
    parser.add_argument("--raw", action="store_true", help="plain completion of the prompt, no chat template")
    parser.add_argument("--system", metavar="TEXT", help="a system message for the chat template")
    parser.add_argument("--uplink-noise", type=float, default=0.0, metavar="S",
                        help="add calibrated Gaussian noise (sigma scale S) to the activations sent to the trunk; "
                             "off by default. Measured in docs/threat-model.md: it does not stop inversion")
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="write where each token's time went (this machine, every stage, every crossing) "
                             "to FILE as Chrome trace-event JSON, for ui.perfetto.dev or chrome://tracing")


def run(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise UsageError("swarmctl ask: the prompt is empty (give the question as an argument: swarmctl ask \"...\")")
    sampling = sampling_params(args)
    if not args.uplink_noise >= 0:
        raise UsageError("--uplink-noise must be 0 or more")
    if args.trace is not None:
        from swarmctl.asker.trace import check_trace_file

        check_trace_file(args.trace)  # before any swarm starts: a path that cannot be written is one line at once
    return asyncio.run(_ask(args, sampling))


async def _ask(args: argparse.Namespace, sampling: SamplingParams) -> int:
    from swarmctl.asker.session import open_session

    async with open_session(session_options(args, trace=args.trace is not None)) as session:
        if args.uplink_noise:
            from swarmctl.audit.noise import UplinkNoise

            session.asker.uplink_transform = UplinkNoise.calibrated(session.model, session.asker.head.slice.stop,
                                                                    args.uplink_noise, n_threads=args.threads)
        trace = _TraceTo(Path(args.trace), session) if args.trace is not None else None
        prompt = _prompt_tokens(session.asker, args)
        note = context_note(len(prompt), args.max_tokens, session.asker.max_context)
        if note:
            print(f"swarmctl ask: note: {note}", file=sys.stderr)
        return await _stream(session.asker, session.trunk, prompt, args.max_tokens, sampling,
                             session.drafting.for_request(), trace, noted=bool(note))


def context_note(prompt_tokens: int, max_tokens: int, context: int) -> str:
    """What to say when --max-tokens reaches past the context: where the answer will stop at the
    latest ("" when it fits). A prompt that leaves no room is refused by the asker itself. The
    answer's last token needs no position of its own, hence one more than the room left."""
    most = context - prompt_tokens + 1
    if prompt_tokens >= context or max_tokens <= most:
        return ""
    return (f"--max-tokens {max_tokens} goes past the context: the prompt takes {prompt_tokens} of its "
            f"{context} tokens, so the answer stops after at most {most} (--ctx sets the context)")


class _TraceTo:
    """Where a request's trace goes, and what its header says about the session."""

    def __init__(self, path: Path, session) -> None:
        self.path = path
        self.session = session

    def write(self, gen) -> None:
        from swarmctl.asker.trace import TraceInfo, generation_trace, write_trace

        if not (gen.timings or gen.fill_timings):
            return  # it stopped before its first step: nothing to show
        info = TraceInfo(model=self.session.model.name, prompt_tokens=gen.prompt_tokens,
                         finish_reason=gen.finish_reason, nodes=self.session.describe_nodes())
        write_trace(self.path, generation_trace(gen, info))
        log.info("trace of %d steps written to %s", len(gen.timings) + len(gen.fill_timings), self.path)


def _prompt_tokens(asker, args: argparse.Namespace) -> list[int]:
    if args.raw:
        return asker.tokenizer.encode_prompt(args.prompt)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    return asker.tokenizer.encode_chat(messages + [{"role": "user", "content": args.prompt}])


async def _stream(asker, trunk, prompt: list[int], max_tokens: int, sampling: SamplingParams,
                  speculation=None, trace: _TraceTo | None = None, noted: bool = False) -> int:
    from swarmctl.asker.head_tail import Generation

    decoder = asker.tokenizer.stream_decoder()
    gen = Generation(b"", len(prompt))
    gen.request_id = __import__("secrets").token_bytes(16)
    t0 = time.perf_counter()
    try:
        async for token in asker.generate(prompt, trunk, max_tokens=max_tokens, sampling=sampling, generation=gen,
                                          speculation=speculation):
            sys.stdout.write(decoder.push(token))
            sys.stdout.flush()
    except BaseException:
        # A request that failed or was interrupted: the steps it took are what explains it, but a
        # trace that cannot be written must not hide why the request stopped.
        if trace is not None:
            try:
                trace.write(gen)
            except OSError as e:
                log.warning("%s", e)
        raise
    elapsed = time.perf_counter() - t0
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    if trace is not None:
        trace.write(gen)
    n = len(gen.tokens)
    log.info("%d prompt tokens, %d generated in %.2fs (%.1f tok/s), finish: %s", len(prompt), n, elapsed,
             n / elapsed if elapsed else 0.0, gen.finish_reason)
    if speculation is not None:
        log.info("speculation: %d steps for %d tokens; %d drafted, %d accepted (%.0f%%)", len(gen.timings), n,
                 gen.drafted, gen.accepted, 100.0 * gen.accepted / gen.drafted if gen.drafted else 0.0)
    # (unless a note said so before the answer began, or the answer has every token asked for)
    if gen.finish_reason == "context" and not noted and n < max_tokens:
        print(f"swarmctl: stopped: the context length ({asker.max_context} tokens) is full", file=sys.stderr)
    return 0

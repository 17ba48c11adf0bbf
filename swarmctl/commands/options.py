"""Options several commands share, defined once (as pip's cmdoptions are): where the trunk runs,
which model, how the asker's machine runs its part, and spot checks. ``ask`` and ``serve`` take
them all; argument types used elsewhere (``positive_int``) live here too."""

from __future__ import annotations

import argparse

from plans.options import HEAD_LAYERS, head_layers_arg

VERIFY_HELP = ("recompute a random share P of the trunk's steps on this machine and compare (0 to 1; default 0: "
               "off). A wrong result is reported to the host and the request goes on here. Needs the whole "
               "model file here; costs up to one more trunk pass per step (benchmarks/bench_verify.py)")


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


def verify_share(text: str) -> float:
    """--verify P: a share of trunk steps in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number between 0 and 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def add_asker_options(parser: argparse.ArgumentParser, *, model_default: str) -> None:
    """The options of a command that runs the asker's side of the U: --transport, --trunk-nodes,
    --model, --head-layers, --stages, --threads, --ctx, --verify, --device, --speculate,
    --draft-model, --draft-tokens."""
    parser.add_argument("--transport", choices=["swarm", "inproc"], default="swarm",
                        help="swarm (default): the trunk runs on the swarm; inproc: every slice in this process")
    parser.add_argument("--trunk-nodes", type=positive_int, default=None, metavar="N",
                        help="trunk processes of the local swarm started when no swarm is joined (default: 1, "
                             "or 2 from 8 cores on)")
    parser.add_argument("--model", metavar="PATH", help=f"a GGUF model (default: {model_default})")
    parser.add_argument("--head-layers", type=head_layers_arg, default=None, metavar="K",
                        help=f"layers kept on this machine at each end of the model (default {HEAD_LAYERS}; a "
                             "joined swarm's plan decides, and a different K here is refused)")
    parser.add_argument("--stages", type=int, default=2, metavar="N", help="trunk stages with --transport inproc "
                                                                           "(default 2)")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N", help="compute threads")
    parser.add_argument("--ctx", type=positive_int, default=None, metavar="N",
                        help="context length in tokens (default: the model's, at most 4096)")
    parser.add_argument("--verify", type=verify_share, default=0.0, metavar="P", help=VERIFY_HELP)
    add_device_option(parser, "this machine's slices (embedding, head, tail, LM head; with --transport inproc, all)")
    parser.add_argument("--speculate", choices=["off", "ngram", "draft", "layerskip", "mtp"], default="off",
                        help="check several tokens per trip through the swarm: ngram (drafts from repeats in the "
                             "prompt and answer; no model), draft (a small model, --draft-model), layerskip (this "
                             "machine's own head and tail layers, the trunk skipped), mtp (the model's multi-token-prediction layer, "
                             "DeepSeek-V3 style, run here from the final hidden state), off (default). "
                             "Greedy output is unchanged; sampled output keeps the model's distribution")
    parser.add_argument("--draft-model", metavar="PATH",
                        help="with --speculate draft: a small GGUF with the model's vocabulary, run on this machine")
    parser.add_argument("--draft-tokens", type=positive_int, default=8, metavar="K",
                        help="drafted tokens per step at most (default 8; adapts down when drafts fail)")


def add_device_option(parser: argparse.ArgumentParser, what: str) -> None:
    """--device: where slices compute (kernels.devices); `swarmctl devices` lists the choices."""
    parser.add_argument("--device", default="auto", metavar="DEVICE",
                        help=f"where {what} compute: auto (default: the first GPU this build of llama.cpp "
                             f"offers, else the CPU), cpu, cuda[:N], metal, vulkan[:N], rocm[:N]; "
                             f"'swarmctl devices' lists them")


def add_sampling_options(parser: argparse.ArgumentParser, *, max_tokens: int | None, max_tokens_help: str) -> None:
    """How answers are sampled (``ask`` and ``chat``): --max-tokens, --temperature, --top-k,
    --top-p, --seed; ``sampling_params`` checks them."""
    parser.add_argument("--max-tokens", type=positive_int, default=max_tokens, metavar="N", help=max_tokens_help)
    parser.add_argument("--temperature", type=float, default=0.2, metavar="T",
                        help="0 = greedy (default 0.2, as the SmolLM2 model card recommends)")
    parser.add_argument("--top-k", type=int, default=40, metavar="K", help="sample from the K likeliest (0 = all)")
    parser.add_argument("--top-p", type=float, default=0.9, metavar="P", help="nucleus sampling mass (default 0.9)")
    parser.add_argument("--seed", type=int, default=None, metavar="S", help="random seed for sampling")


def sampling_params(args: argparse.Namespace):
    """The sampling options as the asker takes them; a value out of range is a UsageError."""
    from kernels.sampling import SamplingParams
    from swarmctl.errors import UsageError

    if not 0.0 < args.top_p <= 1.0:
        raise UsageError("--top-p must be in (0, 1]")
    if args.temperature < 0:
        raise UsageError("--temperature must be 0 or more")
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def session_options(args: argparse.Namespace, *, trace: bool = False):
    """The asker options (``add_asker_options``) as ``open_session`` takes them."""
    from swarmctl.asker.session import SessionOptions

    return SessionOptions(transport=args.transport, model=args.model, trunk_nodes=args.trunk_nodes,
                          head_layers=args.head_layers, stages=args.stages, threads=args.threads, ctx=args.ctx,
                          verify=args.verify, device=args.device, speculate=args.speculate,
                          draft_model=args.draft_model, draft_tokens=args.draft_tokens, trace=trace)

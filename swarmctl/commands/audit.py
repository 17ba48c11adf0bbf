"""Measure what a curious swarm member can read from this project's own traffic.

Runs prompts through a local swarm (a host and two trunk processes on loopback, real QUIC and
mutual TLS) whose trunks capture every frame they receive and send. Then attacks those captures
with public knowledge only (the GGUF): inverts the hidden states the first trunk stage received
back to token ids, and runs the public tail and LM head on what the last stage sent back. Prints
how much of the prompts and answers it recovered. Greedy decoding; raw prompts (no chat template).

The first run builds an inversion table from the model (51 s for the bundled model on one core of
a 2-core machine) and keeps it under --cache.

examples:
  swarmctl audit
  swarmctl audit --prompts my-prompts.txt --head-layers 6 --json report.json
  swarmctl audit --uplink-noise 0.3          # with the noise mitigation on
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from plans.options import HEAD_LAYERS, head_layers_arg
from swarmctl.commands.options import positive_int
from swarmctl.errors import UsageError


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=Path, metavar="FILE",
                        help="one prompt per line ('#' comments, \\n for a newline; default: the bundled 20 "
                             "prompts with names, numbers and code)")
    parser.add_argument("--head-layers", type=head_layers_arg, default=HEAD_LAYERS, metavar="K",
                        help=f"layers the asker keeps at each end (default {HEAD_LAYERS})")
    parser.add_argument("--model", metavar="PATH", help="a GGUF model (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=positive_int, default=8, metavar="N",
                        help="tokens generated per prompt (default 8)")
    parser.add_argument("--uplink-noise", type=_non_negative_float, default=0.0, metavar="S",
                        help="turn the noise mitigation on at sigma scale S (default 0: off)")
    parser.add_argument("--max-candidates", type=_non_negative_int, default=128, metavar="N",
                        help="candidate tokens tried per position at most (default 128; 0: the whole vocabulary)")
    parser.add_argument("--threads", type=positive_int, default=1, metavar="N",
                        help="compute threads of the attack's one-token steps (default 1; building the inversion "
                             "table, once per model, runs its batches on every usable core)")
    parser.add_argument("--cache", type=Path, metavar="DIR",
                        help="where the inversion table is kept (default ~/.cache/swarmctl/audit)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON ('-': JSON on stdout "
                                                       "instead of the table)")


def run(args: argparse.Namespace) -> int:
    from kernels.gguf_file import GGUFFile
    from kernels.spec import ModelSpec
    from swarmctl.audit.meter import AuditSettings, load_prompts, run_audit
    from swarmctl.audit.tables import default_cache_dir
    from swarmctl.model_files.models import resolve_model

    model = resolve_model(args.model)
    prompts = load_prompts(args.prompts)
    if not prompts:
        raise UsageError(f"swarmctl audit: no prompts in {args.prompts}")
    settings = AuditSettings(head_layers=args.head_layers, max_tokens=args.max_tokens,
                             uplink_noise=args.uplink_noise, max_candidates=args.max_candidates,
                             attack_threads=args.threads, cache_dir=args.cache or default_cache_dir())
    with GGUFFile(model) as gguf:
        n_layer = ModelSpec.from_gguf(gguf).n_layer
    if n_layer - 2 * args.head_layers < settings.n_trunks:
        raise UsageError(f"swarmctl audit: --head-layers {args.head_layers} leaves the model's {n_layer} layers "
                         f"too few for {settings.n_trunks} trunk stages")
    report = run_audit(model, prompts, settings)
    if args.json == "-":
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    print(report.table())
    sys.stdout.flush()
    return 0

"""What f16 and q8_0 activations between machines do to the answers (issue 33 item 3); prints JSON.

    python benchmarks/bench_wire_dtype.py [--model GGUF] [--tokens 200] [--cuts 4,11,19,26]

For each held prompt, the model (the bundled one by default) generates ``--tokens`` tokens greedily
in f32; then every position of that text is run again in one pass through the same slices with
every hop between them (asker → stage → … → asker, at ``--cuts``) rounded as each dtype delivers it.
Compared with f32 at each generated position: top-1 agreement (the same argmax) and the KL
divergence KL(f32 || dtype) of the next-token distributions, in nats. Also the bytes a row takes
on the wire, and the first generated token where a free-running greedy answer in that dtype parts
from f32's (how long answers stay identical, for a feel of it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_json  # noqa: E402
from kernels.gguf_file import GGUFFile  # noqa: E402
from kernels.slice import SliceEngine  # noqa: E402
from kernels.spec import ModelSpec, SliceSpec  # noqa: E402
from kernels.tokenizer import Tokenizer  # noqa: E402
from net.wire import DType  # noqa: E402
from swarmctl.model_files.models import resolve_model  # noqa: E402

HELD_PROMPTS = [  # not tuned on: four kinds of text
    "Explain how a refrigerator keeps food cold, step by step.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "The history of the printing press begins",
    "List five things to check before a long bicycle ride and say why each matters.",
]


def run(engines: list[SliceEngine], tokens: list[int], hop: DType, rid: bytes) -> np.ndarray:
    """Logits at every position, each hop's rows rounded as ``hop`` delivers them."""
    x = engines[0].forward(rid, start_pos=0, tokens=tokens)
    for engine in engines[1:-1]:
        x = engine.forward(rid, start_pos=0, hidden=hop.as_received(x))
    logits = engines[-1].forward(rid, start_pos=0, hidden=hop.as_received(x), outputs="all")
    for engine in engines:
        engine.release(rid)
    return logits


def greedy(engines: list[SliceEngine], prompt: list[int], n: int, hop: DType, eog) -> list[int]:
    tokens = list(prompt)
    rid = b"greedy-" + hop.label.encode()
    x = engines[0].forward(rid, start_pos=0, tokens=tokens)
    pos = 0
    out = []
    for step in range(n):
        for engine in engines[1:-1]:
            x = engine.forward(rid, start_pos=pos, hidden=hop.as_received(x))
        logits = engines[-1].forward(rid, start_pos=pos, hidden=hop.as_received(x))
        token = int(np.argmax(logits[-1]))
        out.append(token)
        pos = len(tokens)
        tokens.append(token)
        x = engines[0].forward(rid, start_pos=pos, tokens=[token])
    for engine in engines:
        engine.release(rid)
    return out


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--cuts", default="4,11,19,26", help="layer boundaries: the head ends at the first, the tail "
                                                         "starts at the last, trunk stages between")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    model = resolve_model(args.model)
    tokenizer = Tokenizer(model)
    with GGUFFile(model) as gguf:
        n_layer = ModelSpec.from_gguf(gguf).n_layer
        cuts = [int(c) for c in args.cuts.split(",")]
        bounds = [0, *cuts, n_layer]
        specs = [SliceSpec(a, b, has_embedding=a == 0, has_lm_head=b == n_layer) for a, b in zip(bounds, bounds[1:])]
        engines = [SliceEngine(gguf, s, n_threads=args.threads, max_context=1024) for s in specs]
        n_embd = engines[0].spec.n_embd
        result: dict = {"model": model.name, "cuts": cuts, "hops": len(engines) - 1, "tokens": args.tokens,
                        "row_bytes": {d.label: d.nbytes(1, n_embd) for d in DType}, "prompts": []}
        for prompt_text in HELD_PROMPTS:
            prompt = tokenizer.encode_chat([{"role": "user", "content": prompt_text}])
            reference = greedy(engines, prompt, args.tokens, DType.F32, tokenizer.is_end_of_generation)
            text = prompt + reference
            want = log_softmax(run(engines, text, DType.F32, b"ref")[len(prompt) - 1:-1])
            row = {"prompt": prompt_text[:40], "prompt_tokens": len(prompt)}
            for hop in (DType.F16, DType.Q8_0):
                got = log_softmax(run(engines, text, hop, b"hop-" + hop.label.encode())[len(prompt) - 1:-1])
                agree = float(np.mean(want.argmax(axis=1) == got.argmax(axis=1)))
                kl = np.sum(np.exp(want) * (want - got), axis=1)
                free = greedy(engines, prompt, args.tokens, hop, tokenizer.is_end_of_generation)
                parted = next((i for i, (a, b) in enumerate(zip(reference, free)) if a != b), None)
                row[hop.label] = {"top1_agreement": round(agree, 4), "kl_mean": float(np.mean(kl)),
                                  "kl_max": float(np.max(kl)), "free_running_identical_tokens":
                                      args.tokens if parted is None else parted}
            result["prompts"].append(row)
        for hop in ("f16", "q8_0"):
            rows = [r[hop] for r in result["prompts"]]
            result[hop] = {"top1_agreement_median": statistics.median(r["top1_agreement"] for r in rows),
                           "top1_agreement_min": min(r["top1_agreement"] for r in rows),
                           "kl_mean_median": statistics.median(r["kl_mean"] for r in rows),
                           "free_running_identical_tokens": [r["free_running_identical_tokens"] for r in rows]}
        for engine in engines:
            engine.close()
    emit_json(result, args.out)


if __name__ == "__main__":
    main()

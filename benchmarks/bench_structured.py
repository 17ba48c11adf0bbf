"""What grammar-constrained decoding (response_format) costs the asker; prints JSON.

    python benchmarks/bench_structured.py [--tokens 64] [--rounds 5] [--threads 2]

The bundled model whole in this process (head and tail in the asker, the trunk in process: what
an asker does per token, without the network), one request at a time, greedy: decode tok/s
plain and with the JSON grammar (``{"type": "json_object"}``: llama.cpp's grammar engine masks the
logits before each token, kernels/grammar.py), alternating, medians over ``--rounds``. Both run
to ``--tokens`` (end-of-generation ignored), so they decode the same number of tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_json  # noqa: E402
from kernels.grammar import Grammar  # noqa: E402
from kernels.sampling import SamplingParams  # noqa: E402
from swarmctl.asker.head_tail import Asker, InprocTrunk, generate_all, u_split  # noqa: E402
from swarmctl.model_files.models import default_model_path  # noqa: E402

PROMPT = "Describe the city of Paris as a JSON object with its name, country and population."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    model = default_model_path()
    asker = Asker(model, 4, n_threads=args.threads, max_context=512)
    trunk = InprocTrunk(asker.gguf, u_split(asker.spec.n_layer, 4, 1).trunk, n_threads=args.threads, max_context=512)
    prompt = asker.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])

    async def decode(grammar: Grammar | None) -> float:
        t0 = time.perf_counter()
        gen = await generate_all(asker, prompt, trunk, max_tokens=args.tokens, sampling=SamplingParams(temperature=0),
                                 ignore_eos=True, grammar=grammar)
        return len(gen.tokens) / (time.perf_counter() - t0)

    rates: dict[str, list[float]] = {"plain": [], "json_grammar": []}
    asyncio.run(decode(None))  # warm-up
    for _ in range(args.rounds):
        rates["plain"].append(asyncio.run(decode(None)))
        grammar = Grammar.for_json(asker.tokenizer)
        try:
            rates["json_grammar"].append(asyncio.run(decode(grammar)))
        finally:
            grammar.close()
    trunk.close()
    asker.close()
    plain, constrained = statistics.median(rates["plain"]), statistics.median(rates["json_grammar"])
    emit_json({"model": model.name, "tokens": args.tokens, "threads": args.threads,
               "tok_s_median": {"plain": round(plain, 2), "json_grammar": round(constrained, 2)},
               "constrained_over_plain": round(constrained / plain, 3), "rounds": rates}, args.out)


if __name__ == "__main__":
    main()

"""The soak's reference answers: each prompt's greedy answer, computed once in this process (the
asker and two trunk stages in-process; in-process and swarm runs are token-identical, tested
elsewhere). A request counts as correct only if its text equals its prompt's reference."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from harness.soak.config import Prompt


def reference_answers(prompts: Sequence[Prompt], threads: int) -> tuple[list[str], list[int]]:
    """Each prompt's greedy answer as `swarmctl ask --temperature 0` would print it (without the
    final newline), computed in this process; and each prompt's length in tokens."""
    from kernels.sampling import SamplingParams
    from swarmctl.asker.head_tail import Asker, InprocTrunk, generate_all, u_split
    from swarmctl.model_files.models import default_model_path

    asker = Asker(default_model_path(), 4, n_threads=threads)
    trunk = InprocTrunk(asker.gguf, u_split(asker.spec.n_layer, 4, 2).trunk, n_threads=threads,
                        max_context=asker.max_context)

    def encode(mode: str, text: str) -> list[int]:
        return asker.tokenizer.encode_prompt(text) if mode == "raw" else \
            asker.tokenizer.encode_chat([{"role": "user", "content": text}])

    async def run() -> tuple[list[str], list[int]]:
        texts, lengths = [], []
        for mode, text, max_tokens in prompts:
            tokens = encode(mode, text)
            gen = await generate_all(asker, tokens, trunk, max_tokens=max_tokens,
                                     sampling=SamplingParams(temperature=0))
            decoder = asker.tokenizer.stream_decoder()
            texts.append("".join(decoder.push(t) for t in gen.tokens) + decoder.flush())
            lengths.append(len(tokens))
        return texts, lengths

    try:
        return asyncio.run(run())
    finally:
        trunk.close()
        asker.close()

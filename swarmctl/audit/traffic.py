"""The asker's side of an audit: run prompts through a swarm, keeping what was really asked and
answered. This is the truth the attack is scored against; none of it reaches the attack code."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from kernels.sampling import SamplingParams
from swarmctl.asker.head_tail import Asker, generate_all
from swarmctl.node.local_swarm import LocalSwarm
from swarmctl.asker.link import SwarmLink

GREEDY = SamplingParams(temperature=0)


@dataclass
class PromptRun:
    text: str
    request_id: bytes  # the id its packets carry on the wire
    prompt_tokens: list[int]
    generated: list[int]  # the asker's tokens (greedy), end-of-generation excluded


async def run_prompts(swarm: LocalSwarm, model: Path, prompts: Sequence[str], *, max_tokens: int,
                      uplink_transform: Callable[[np.ndarray], np.ndarray] | None = None,
                      n_threads: int | None = None) -> list[PromptRun]:
    """Each prompt as a raw completion (no chat template: only the user's own text is scored), one
    after another, greedy."""
    link = await SwarmLink.open(swarm.asker_home, alive_check=swarm.check_alive, min_stages=swarm.n_trunks)
    asker = None
    try:
        asker = Asker(model, link.head_layers, n_threads=n_threads)
        asker.uplink_transform = uplink_transform
        link.check_model(asker.gguf)
        runs = []
        for text in prompts:
            tokens = asker.tokenizer.encode_prompt(text)
            gen = await generate_all(asker, tokens, link, max_tokens=max_tokens, sampling=GREEDY)
            runs.append(PromptRun(text, gen.request_id, tokens, gen.tokens))
        return runs
    finally:
        await link.close()
        if asker is not None:
            asker.close()

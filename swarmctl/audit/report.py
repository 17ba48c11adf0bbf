"""Scoring an attack against the truth the asker kept, and printing it as a table or JSON."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from .attack import AttackResult
from .invert import EXACT_MATCH
from .traffic import PromptRun


@dataclass
class PromptScore:
    text: str
    recovered_text: str  # the prompt as the first stage's owner reads it back
    prompt_tokens: int
    prompt_recovered: int
    generated_tokens: int  # generated tokens that went back up through the head (all but the last)
    generated_recovered: int
    downlink_tokens: int
    downlink_agree: int

    @property
    def complete(self) -> bool:
        return self.prompt_tokens > 0 and self.prompt_recovered == self.prompt_tokens


@dataclass
class AuditReport:
    model: str
    head_layers: int
    uplink_noise: float  # sigma scale of the mitigation; 0 = off
    max_candidates: int
    prompts: list[PromptScore] = field(default_factory=list)
    candidates: list[int] = field(default_factory=list)  # tried per attacked token
    exact: int = 0  # attacked tokens whose kept candidate reproduced the observed state (early exit)
    missing: int = 0  # prompts whose uplink the captures did not hold from position 0
    table_build_s: float = 0.0
    attack_s: float = 0.0

    def _sum(self, name: str) -> int:
        return sum(getattr(p, name) for p in self.prompts)

    def summary(self) -> dict:
        def rate(a: int, b: int) -> float | None:
            return round(a / b, 4) if b else None

        tried = self.candidates or [0]
        return {
            "prompt_tokens": self._sum("prompt_tokens"),
            "prompt_token_recovery": rate(self._sum("prompt_recovered"), self._sum("prompt_tokens")),
            "generated_tokens": self._sum("generated_tokens"),
            "generated_token_recovery": rate(self._sum("generated_recovered"), self._sum("generated_tokens")),
            "prompts_recovered_completely": rate(sum(p.complete for p in self.prompts), len(self.prompts)),
            "candidates_per_token_mean": round(statistics.fmean(tried), 2),
            "candidates_per_token_median": statistics.median(tried),
            "candidates_per_token_max": max(tried),
            "early_exit_share": rate(self.exact, len(self.candidates)),
            "downlink_tokens": self._sum("downlink_tokens"),
            "downlink_top1_agreement": rate(self._sum("downlink_agree"), self._sum("downlink_tokens")),
        }

    def to_dict(self) -> dict:
        return {"model": self.model, "head_layers": self.head_layers, "uplink_noise": self.uplink_noise,
                "max_candidates": self.max_candidates, "early_exit_distance": EXACT_MATCH,
                "prompts": len(self.prompts), "prompts_not_captured": self.missing, **self.summary(),
                "table_build_s": round(self.table_build_s, 1), "attack_s": round(self.attack_s, 1),
                "per_prompt": [{**asdict(p), "complete": p.complete} for p in self.prompts]}

    def table(self) -> str:
        s = self.summary()

        def pct(x: float | None) -> str:
            return "-" if x is None else f"{100 * x:.1f} %"

        noise = f"uplink noise {self.uplink_noise:g}" if self.uplink_noise else "no mitigation"
        lines = [
            f"audit: {self.model}, K = {self.head_layers}, {len(self.prompts)} prompts, {noise}",
            "",
            f"  {'what a curious member recovers':<46} {'measured':>10}",
            f"  {'prompt tokens (first stage, uplink)':<46} {pct(s['prompt_token_recovery']):>10}   "
            f"of {s['prompt_tokens']}",
            f"  {'prompts recovered completely':<46} {pct(s['prompts_recovered_completely']):>10}",
            f"  {'generated tokens (first stage, uplink)':<46} {pct(s['generated_token_recovery']):>10}   "
            f"of {s['generated_tokens']}",
            f"  {'generated tokens (last stage, downlink top-1)':<46} {pct(s['downlink_top1_agreement']):>10}   "
            f"of {s['downlink_tokens']}",
            f"  {'candidates tried per token (mean/median/max)':<46} "
            f"{s['candidates_per_token_mean']:>10} / {s['candidates_per_token_median']} / "
            f"{s['candidates_per_token_max']}   (cap {self.max_candidates or 'none'})",
            f"  {'tokens reproduced exactly (search ended early)':<46} {pct(s['early_exit_share']):>10}",
            "",
            f"  {'prompt (recovered by the first stage)':<66} tokens",
        ]
        for p in self.prompts:
            shown = p.recovered_text.replace("\n", "\\n")
            shown = shown if len(shown) <= 64 else shown[:61] + "..."
            lines.append(f"  {shown:<66} {p.prompt_recovered}/{p.prompt_tokens}")
        lines.append("")
        lines.append(f"  attack {self.attack_s:.1f}s" + (f", table built in {self.table_build_s:.1f}s"
                                                         if self.table_build_s else ", table from cache"))
        if self.missing:
            lines.append(f"  {self.missing} prompt(s) not captured from position 0 were left out")
        return "\n".join(lines)


def score(runs: Sequence[PromptRun], result: AttackResult, decode: Callable[[list[int]], str], *,
          model: str, head_layers: int, uplink_noise: float, max_candidates: int) -> AuditReport:
    """``decode`` turns token ids into text (the public tokenizer) for showing what was read back."""
    report = AuditReport(model, head_layers, uplink_noise, max_candidates, table_build_s=result.table_build_s,
                         attack_s=result.attack_s)
    for run in runs:
        inversion = result.inversions.get(run.request_id)
        if inversion is None:
            report.missing += 1
            continue
        truth = run.prompt_tokens + run.generated
        got = inversion.tokens
        n_prompt = len(run.prompt_tokens)
        hits = [a == b for a, b in zip(got, truth)]
        downlink = result.downlink.get(run.request_id, [])
        compared = list(zip(downlink, run.generated))
        report.prompts.append(PromptScore(
            text=run.text, recovered_text=decode(got[:n_prompt]),
            prompt_tokens=n_prompt, prompt_recovered=sum(hits[:n_prompt]),
            generated_tokens=max(0, len(got) - n_prompt), generated_recovered=sum(hits[n_prompt:]),
            downlink_tokens=len(compared), downlink_agree=sum(a == b for a, b in compared)))
        report.candidates += [g.tried for g in inversion.guesses]
        report.exact += sum(g.distance <= EXACT_MATCH for g in inversion.guesses)
    return report

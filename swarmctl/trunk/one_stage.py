"""Who re-checked this stage alone: the stage's own record, the host's evidence.

An asker whose spot check caught a wrong result re-checks its route stage by stage: it sends each
stage its clean input as a request of its own that comes back from that stage alone (ONE_STAGE
steps, swarmctl/asker/verify.py), and reports the stage whose answer was wrong (``bad_result``,
attributed). The host counts such a report only if the accused stage computed one-stage steps for
the accuser's account, under the plan version the report names, since the host last counted one
from that account (swarmctl/host/reports.py). This is where the stage keeps that record; the host
reads it from the stage's ``stats`` (``one_stage``).

What it takes to fake: the account is bound to the sender's certificate where a request enters
(stage_step.account_of), and a step is recorded only once this stage computed it, on that account's
budget. So an accuser cannot make the record up with a message to the host; it has to send this
stage steps. A stage could leave an accuser out of its record; that only spares it the host's own
re-check (swarmctl/host/recheck.py), which it could as well answer honestly.
"""

from __future__ import annotations

MAX_ACCOUNTS = 1024  # accounts recorded at once (the one heard from longest ago goes first)


class OneStageLedger:
    def __init__(self) -> None:
        # account → [one-stage steps this stage computed for it, plan version of the latest]; most recent last
        self._steps: dict[str, list[int]] = {}

    def record(self, account: str, plan_version: int) -> None:
        """This stage computed a one-stage step of ``account``'s under plan ``plan_version``."""
        entry = self._steps.pop(account, None) or [0, plan_version]
        entry[0] += 1
        entry[1] = plan_version
        self._steps[account] = entry
        if len(self._steps) > MAX_ACCOUNTS:
            del self._steps[next(iter(self._steps))]

    def stats(self) -> dict[str, list[int]]:
        return {account: list(entry) for account, entry in self._steps.items()}

"""Who a plan is made over: the proven trunks; the unproven too where the proven cannot serve alone
(a swarm starting up), else each unproven one proves itself on a trial plan of its own first;
members waiting out a hold (staging.py) only where the others cannot serve without them. And the
holds as what those trunks are refused with: a hold refuses a registered trunk, and ends its
refusal when it ends (unless it is refused for something else by then).

No I/O: it asks the planner (proposals.py) and writes ``refused`` and ``trial`` on TrunkInfo; the
keeper (planning.py) re-plans with what it chooses, sends the trials, and sets its timer after
holds change."""

from __future__ import annotations

import logging
from typing import Collection, NamedTuple

from plans.layout import ModelLayout
from plans.nodes import NodeDescriptor
from plans.plan import Plan
from plans.planner import Constraints, ExpertPlacement, PlanError, Proposal
from swarmctl.node.home import NodeConfig

from .figures import PlanInputs
from .proposals import propose, trial_ranges
from .staging import Hold, Staging
from .trunks import Trunks

log = logging.getLogger("swarmctl.host")


class Choice(NamedTuple):
    """What a plan is made of: the planner's ``proposal`` and ``placement`` (None: it could not plan,
    ``problem`` says why), and the unproven trunks it left to prove themselves on trials."""

    proposal: Proposal | None
    placement: ExpertPlacement | None
    problem: str
    on_trial: list[str]


class PlanMembers:
    def __init__(self, layout: ModelLayout, config: NodeConfig, trunks: Trunks, staging: Staging) -> None:
        self.layout = layout
        self.config = config  # (its ``expert_nodes``, as the keeper's settings have it now)
        self.trunks = trunks
        self.staging = staging
        self.inputs = PlanInputs(trunks, self.held)

    def propose(self, nodes: list[NodeDescriptor], constraints: Constraints):
        """(proposal, placement) over ``nodes``; PlanError if they cannot serve."""
        return propose(self.layout, nodes, constraints, self.config.expert_nodes)

    def _try(self, constraints: Constraints, with_unproven: bool):
        """(proposal, placement, "") over the trunks that can serve, or (None, None, why not)."""
        self.inputs.with_unproven = with_unproven
        try:
            return *self.propose(self.inputs.descriptors(), constraints), ""
        except PlanError as e:
            return None, None, str(e)

    def _choose_once(self, constraints: Constraints) -> tuple[list[str], tuple]:
        """(the unproven trunks, the planner's try): with the proven trunks, or with the unproven
        too where the proven cannot serve alone."""
        unproven = [name for name, t in self.trunks.items() if not t.refused and not t.checking and not t.proven]
        tried = self._try(constraints, False)
        if unproven and tried[0] is None:
            tried = self._try(constraints, True)
        return unproven, tried

    def choose(self, constraints: Constraints) -> Choice:
        """The members of the next plan. Members waiting out a hold are planned where the others
        cannot serve without them: first those that only rejoined right after leaving, then those
        that missed a deadline (their holds end here: the keeper sets its timer again)."""
        unproven, tried = self._choose_once(constraints)
        for missed in (False, True):
            held = self.staging.waiting({name: t.refused for name, t in self.trunks.items()}, missed)
            if tried[0] is not None or not held:
                continue
            log.warning("the others cannot serve without %s: planned before %s wait is over", ", ".join(held),
                        "its" if len(held) == 1 else "their")
            self.release(held)
            unproven, tried = self._choose_once(constraints)
        if self.inputs.with_unproven:  # planned as they are (the proven cannot serve alone): no trial
            for name in unproven:
                self.trunks[name].trial = None
        return Choice(*tried, [] if self.inputs.with_unproven else unproven)

    def trials(self, on_trial: list[str], plan: Plan, constraints: Constraints) -> dict[str, tuple[int, int]]:
        """The layers each trunk of ``on_trial`` with no trial yet proves on (proposals.py
        ``trial_ranges``): those the planner would give it, or the first trunk layer of ``plan``."""
        waiting = [name for name in on_trial if self.trunks[name].trial is None and self.trunks[name].conn.is_open]
        if not waiting:
            return {}
        try:
            would_be, _ = self.propose(self.inputs.descriptors(unproven=True), constraints)
        except PlanError:
            would_be = None
        return trial_ranges(waiting, plan, would_be)

    def serve_without(self, names: Collection[str], constraints: Constraints) -> bool:
        """Whether the others (held members as if their wait were over) can serve without ``names``."""
        nodes = [n for n in self.inputs.descriptors(unproven=True, held=True) if n.name not in names]
        try:
            return self.propose(nodes, constraints)[0] is not None
        except PlanError:
            return False

    # --- holds as refusals ---

    def held(self, name: str) -> bool:
        """``name`` is registered and refused by its hold (not for another reason)."""
        trunk = self.trunks.get(name)
        return self.staging.held(name, trunk.refused if trunk is not None else None)

    def refuse(self, name: str, hold: Hold) -> None:
        """A new hold: ``name`` is refused with it (unless it is refused already)."""
        trunk = self.trunks.get(name)
        if trunk is not None and not trunk.refused:
            trunk.refused = hold.why
        log.warning("trunk %s %s", name, hold.why)

    def release(self, names: list[str]) -> bool:
        """End the holds of ``names``; True if one of them is registered (it can be planned now)."""
        back = [name for name in names if self.held(name)]
        for name in back:
            self.trunks[name].refused = ""
        self.staging.release(names)
        return bool(back)

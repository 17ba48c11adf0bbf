"""What a stage decides about one step of a request, with no I/O.

A step (a PREFILL or DECODE packet) arrives at a stage; before it runs, the stage checks it fits
what the plan gives this trunk now (``check_packet``) and whose request it is: one passed on by
the stage before, or one entering here on its sender's own account (``enters_here``). While the
step computes, a plan may arrive that moves this stage: its output is then refused with a retry
(``moved_during_step``). Once it ran, its output travels on as the plan says (``onward``): to the
next stage, to the asker's results stream from the last stage, or back to its sender for a
re-check of this stage alone. The trunk's ``StageRequests`` (swarmctl/trunk/requests.py) carries
these out; tests drive them directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from net.wire import MAX_HOPS, ActivationPacket, Hop, PacketKind
from plans.plan import Plan, StageAssignment


@dataclass(frozen=True)
class Serving:
    """What this trunk serves as a step arrives (``Assignment``'s state, read once)."""

    plan: Plan | None
    stage: StageAssignment | None
    running: bool  # a runner (and its engine) is up
    swapping: bool  # a load replaces the layers (assignment_core.py)
    n_embd: int  # the engine's width (0 without one)


def check_packet(packet: ActivationPacket, now: Serving) -> tuple[str, bool]:
    """What is wrong with a step, if anything ("" : nothing), and whether a resend under a newer
    plan may work (the sender then reroutes; otherwise the request fails)."""
    if now.swapping:
        return f"the plan changed (now v{now.plan.version}): this stage is loading other layers", True
    if now.stage is None or not now.running or now.plan is None:
        return "this trunk is not serving any layers right now", True
    if packet.plan_version != now.plan.version:
        return f"stale plan: packet has version {packet.plan_version}, the swarm is at {now.plan.version}", True
    if packet.layer_index != now.stage.start:
        return f"this stage runs layers [{now.stage.start}, {now.stage.stop}), not layer {packet.layer_index}", False
    if packet.data.ndim != 2 or packet.data.shape[1] != now.n_embd:
        return (f"activations of shape {list(packet.data.shape)} do not fit: expected "
                f"[n_tokens, {now.n_embd}]"), False
    if len(packet.hops) >= MAX_HOPS:  # this stage's record would not fit on the packet it sends on
        return f"the packet has passed {len(packet.hops)} stages already; at most {MAX_HOPS} fit", False
    return "", False


def previous_member(plan: Plan, stage: StageAssignment) -> str | None:
    """Who serves the layers just before ``stage`` (None: the asker's head does)."""
    return next((s.member for s in plan.stages if s.stop == stage.start), None)


def enters_here(plan: Plan, stage: StageAssignment, sender: str) -> bool:
    """From the stage before: a hop of a request that entered earlier, whose results address that
    stage passes on. From anyone else: a request entering here (at the first stage, an ask; at a
    later one, an asker re-checking the route stage by stage: swarmctl/asker/verify.py), whose
    results can only go to the sender's own results streams, on the sender's budget."""
    return stage.start == plan.head_layers or sender != previous_member(plan, stage)


def account_of(reply_to: str, plan: Plan) -> str:
    """Whose budget a request spends and whose turn it takes: its member's account (one per
    invite: Plan.account): reply_to's ("member/session"), which is bound to the sender's
    certificate wherever a request enters and only passed on by the stage before."""
    return plan.account(reply_to.partition("/")[0])


def moved_during_step(same_runner: bool, plan_now: Plan | None, stage_now: StageAssignment | None,
                      stage: StageAssignment) -> str:
    """Why a step's output cannot go on ("" : it can): the plan changed while it computed, and
    its layers are gone from here (or going), with the request's cache. The sender starts it over
    on the new route. ``same_runner``: the runner that computed it still serves."""
    if same_runner and stage_now is not None and plan_now is not None and \
            (stage_now.start, stage_now.stop) == (stage.start, stage.stop):
        return ""
    version = f"now v{plan_now.version}" if plan_now is not None else "no plan now"
    return f"the plan changed ({version})"


class Destination(Enum):
    NEXT_STAGE = "next stage"
    RESULTS = "results"  # the asker's results stream, from the last stage
    SENDER = "sender"  # a re-check of this stage alone goes back the way it came


@dataclass(frozen=True)
class Onward:
    packet: ActivationPacket
    to: Destination


def onward(packet: ActivationPacket, out: np.ndarray, hop: Hop, plan: Plan, stage: StageAssignment,
           reply_to: str) -> Onward:
    """A step's output under ``plan``, from ``stage``, and where it goes. The plan says how this
    stage's output travels on (plans/wire.py); a re-check goes back as it came."""
    is_last = stage.stop == plan.trunk_range[1]
    back = packet.one_stage
    dtype = packet.dtype if back else stage.send_dtype
    sent = ActivationPacket(PacketKind.RESULT if is_last or back else packet.kind, packet.request_id,
                            plan.version, stage.stop, packet.start_pos, out, dtype, reply_to,
                            hops=(*packet.hops, hop), rewind=packet.rewind, verify=packet.verify,
                            trace=packet.trace, one_stage=back,
                            prefix=packet.prefix if not (is_last or back) else b"")
    to = Destination.SENDER if back else (Destination.RESULTS if is_last else Destination.NEXT_STAGE)
    return Onward(sent, to)

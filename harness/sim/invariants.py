"""What must hold after every simulated run, whatever its faults:

- every ask returns exactly the fault-free tokens, or ends with a clear error (the product's own
  EngineError kinds, one line) within its deadline; with no faults at all (only the network's
  delay, loss, duplication and reordering), every ask returns its tokens;
- an ask of a revoked member ends with the revocation, at once (within REVOKE_BOUND_S of it, or of
  when the host runs and hears again if it was down or frozen), and is not served past that;
  the other members' asks are not affected by it;
- once every ask is over and the faults have stopped, no live stage holds a request, a route, a
  request lock, KV or budget for any of them;
- once the faults have stopped, the host's plan is complete again (every trunk layer on a ready
  stage) within PLAN_BOUND_S, and still complete at the end, as long as a trunk lives; at the end
  every live trunk is in it (one that stopped and rejoined, or joined late, is used again);
- no member ever holds more at a stage than its budget there allows (requests, KV bytes), no
  stage more KV than all members together may hold, and no engine a request nobody is charged for;
- no task died with an unhandled exception, and nothing logged a traceback;
- a trunk told to stop (a 'rejoin': Ctrl-C) has stopped within STOP_BOUND_S (run.py).
"""

from __future__ import annotations

from harness.sim.run import ASK_TIMEOUT_S, PLAN_BOUND_S, RunResult
from harness.sim.schedule import REVOKED_ASKER
from harness.sim.world import WorldSpec

REVOKE_BOUND_S = 5.0  # a revoked member's running asks end within this of the revocation
DEADLINE_SLACK_S = 5.0  # an ask's error may come this long after its deadline (the last step's wait)
CLEAR_ERRORS = {"SwarmError", "BusyError", "EngineError", "ContextOverflowError"}


def check(result: RunResult, spec: WorldSpec) -> list[str]:
    failures: list[str] = []
    faulty = bool(result.schedule.faults)
    revoked_at = result.revoked_at
    for r in result.asks:
        who = f"ask of {r.ask.asker} at {r.started:.2f} ({list(r.ask.prompt)}, {r.ask.max_tokens} tokens)"
        if r.ended is None:
            failures.append(f"{who} never ended")
            continue
        took = r.ended - r.started
        revoked = revoked_at is not None and r.ask.asker == REVOKED_ASKER and r.ended > revoked_at
        if r.tokens is not None:
            want = result.reference.get((r.ask.prompt, r.ask.max_tokens))
            if want is None:  # (a run stopped by its wall-time limit: that is reported too)
                failures.append(f"{who} returned tokens, but the run ended before the fault-free ones were made")
            elif r.tokens != want:
                failures.append(f"{who} returned tokens {r.tokens}, not the fault-free {want}")
            if revoked and r.ended - max(revoked_at, r.started) > REVOKE_BOUND_S:
                failures.append(f"{who}: revoked at {revoked_at:.2f}, it was still served until {r.ended:.2f}")
            continue
        if r.error_type not in CLEAR_ERRORS:
            failures.append(f"{who} ended with {r.error_type}: {r.error}")
        elif "\n" in r.error or not r.error:
            failures.append(f"{who} ended with an error that is not one clear line: {r.error!r}")
        if took > ASK_TIMEOUT_S + DEADLINE_SLACK_S:
            failures.append(f"{who} ended {took:.1f} s after it began, past its {ASK_TIMEOUT_S:.0f} s deadline")
        if revoked:
            if "membership revoked" not in r.error:
                failures.append(f"{who}: revoked at {revoked_at:.2f}, it ended with {r.error!r}")
            elif r.ended - max(revoked_at, r.started) > REVOKE_BOUND_S:
                failures.append(f"{who}: revoked at {revoked_at:.2f}, it ended only at {r.ended:.2f}")
        elif not faulty:
            failures.append(f"{who} failed with no fault in the run: {r.error}")
    for name, held in result.leftovers.items():
        if any(held.values()):
            failures.append(f"{name} still holds {held} after every ask ended")
    failures += _plan_complete_again(result)
    failures += [f"over budget: {line}" for line in result.over_budget]
    failures += [f"unhandled: {crash}" for crash in result.crashes]
    failures += [f"not stopped cleanly: {line}" for line in result.left_running]
    return failures


def _plan_complete_again(result: RunResult) -> list[str]:
    span = result.plan
    if span is None or not result.trunks_alive:
        return []  # (the run did not get that far, or every trunk was killed)
    if span.complete_at is None or span.complete_at - span.since > PLAN_BOUND_S:
        when = "never" if span.complete_at is None else f"only at {span.complete_at:.2f}"
        return [f"the plan was not complete within {PLAN_BOUND_S:.0f} s of the faults stopping at "
                f"{span.since:.2f} ({when}; trunks alive: {', '.join(result.trunks_alive)})"]
    if not span.complete_now:
        return [f"the plan was complete again at {span.complete_at:.2f}, but not at the end of the run"]
    # A trunk that rejoined or joined late is used again, unless the host's damping holds it out (a
    # member back within a minute of leaving, a second time; one that missed a ready deadline:
    # plans/hysteresis.py), or a failed check of the host's refuses it a while (swarmctl/host/checks.py): the
    # product's design, not a failure
    left_out = sorted(set(result.trunks_alive) - set(result.planned or ()) - set(result.held_out))
    if result.planned is not None and left_out:
        return [f"trunks alive but not in the host's plan at the end: {', '.join(left_out)} "
                f"(planned: {', '.join(result.planned)})"]
    return []

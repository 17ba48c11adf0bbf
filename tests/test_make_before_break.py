"""Issue 30 item 2b: a plan change is make-before-break (swarmctl/host/planning.py, I/O-free).

While the plan in use serves (every stage ready, every member there), a new plan is *staged*:
sent to its trunks to load beside the plan in use, never to askers. Askers switch only once every
stage of the new plan proved ready; a member that does not get ready by the deadline is left out
and the plan in use stays. Before this, the host published the new plan at once: askers got a plan
whose stages were not ready, and asks failed until they were (61 s in the issue's case). The same
over real processes: tests/test_swarm.py (a third trunk joins while asks run) and
tests/test_layer_proof.py (a proven member that never loads its staged layers).

Issue 43: a published plan's stages have a deadline too (a proven member that never loaded kept
the swarm incomplete until it disconnected, 60 and 90 s); a member that missed one, or that comes
straight back after leaving, is left out for a while, longer each time; plan versions are never
issued twice; links that flap re-plan through the speeds' sustain-and-settle gate.
"""

from __future__ import annotations

from harness.planning_host import GB, SMOL, Host, flapping
from plans.hysteresis import MISSED_HOLD_S, REJOIN_HOLD_S, SETTLE_S, SUSTAIN_S, ready_deadline_s


def test_a_new_member_loads_beside_the_plan_in_use_and_askers_switch_when_it_is_ready(tmp_path):
    host = Host(tmp_path, {"alice": 1.0, "bob": 1.0})
    old = host.serve()
    seen = len(host.asker.plans)
    host.join("carol", 1.0)  # the planner spreads the layers over three now
    staged = host.planning.staged
    assert staged is not None and staged.version > old.version and len(staged.stages) == 3
    assert host.planning.plan is old and old.complete and old.next_version == staged.version
    # askers heard of no other plan than the one in use; every trunk of the new plan got it staged,
    # after the plan in use
    assert {p.version for p in host.asker.plans[seen:]} <= {old.version}
    for name in ("alice", "bob", "carol"):
        assert host.sent(name)[-1].staged and host.sent(name)[-1].version == staged.version
        assert not host.sent(name)[-2].staged and host.sent(name)[-2].next_version == staged.version
    for name in ("alice", "carol"):
        host.ready(name, staged.version)
        assert host.planning.plan is old  # not all of it yet: the old plan serves on
    assert all(p.complete for p in host.asker.plans[seen:])
    host.ready("bob", staged.version)
    now = host.planning.plan
    assert now.version == staged.version and now.complete and not now.staged and host.planning.staged is None
    assert [p.version for p in host.asker.plans[seen:] if p.version != old.version] == [staged.version]
    assert all(p.complete for p in host.asker.plans[seen:])  # never an incomplete plan to askers
    assert all(not p.staged for p in host.asker.plans)
    assert (tmp_path / "plan_version").read_text() == str(staged.version)


def test_a_member_that_never_loads_its_staged_layers_is_left_out_and_the_plan_in_use_stays(tmp_path):
    host = Host(tmp_path, {"alice": 1.0, "bob": 1.0})
    old = host.serve()
    seen = len(host.asker.plans)
    host.join("mallory", 1.0)  # proved its claims, then never loads what it is given
    staged = host.planning.staged
    for s in staged.stages:
        if s.member != "mallory":
            host.ready(s.member, staged.version)
    assert host.planning.plan is old
    host.planning._staged_overdue(staged.version)  # (the deadline's timer)
    assert "did not load layers" in host.trunks["mallory"].refused
    assert host.planning.staged is None
    kept = host.planning.plan
    assert kept.assignments() == old.assignments() and kept.complete and kept.next_version == 0
    assert all(p.complete and "mallory" not in [s.member for s in p.stages] for p in host.asker.plans[seen:])
    assert host.sent("alice")[-1].version == kept.version and host.sent("alice")[-1].next_version == 0


def test_a_replan_while_one_is_staged_stages_the_newer_one(tmp_path):
    host = Host(tmp_path, {"alice": 1.0, "bob": 1.0})
    old = host.serve()
    host.join("carol", 1.0)
    first = host.planning.staged
    host.join("dave", 1.0)
    second = host.planning.staged
    assert second.version > first.version and len(second.stages) == 4 and host.planning.plan is old
    assert host.planning.plan_of(first.version) is None  # a late ready for the first one counts for nothing
    for s in second.stages:
        host.ready(s.member, second.version)
    assert host.planning.plan.version == second.version and host.planning.plan.complete


def test_a_plan_that_lost_a_member_is_replaced_at_once(tmp_path):
    """Nothing to keep serving: a plan whose member left is broken already, so the new plan goes
    out at once (as before)."""
    host = Host(tmp_path, {"alice": 1.0, "bob": 1.0, "carol": 1.0})
    old = host.serve()
    host.trunks["bob"].conn.is_open = False
    del host.trunks["bob"]
    host.planning.replan()
    assert host.planning.staged is None and host.planning.plan.version > old.version
    assert "bob" not in [s.member for s in host.asker.plans[-1].stages]


# --- issue 43 ---

def test_a_published_stage_that_never_loads_is_left_out_at_its_deadline(tmp_path):
    """Item 5: a proven member registers and never loads; an honest member of the plan in use leaves
    (a restart), so the new plan is published at once, with the stage that never loads. Before,
    only staged plans had a deadline: askers held an incomplete plan until the member disconnected.
    Now it is left out once its deadline (ready_deadline_s of its stage) passed."""
    host = Host(tmp_path, {"alice": 1.0, "bob": 1.0})
    host.serve()
    host.join("mallory")  # proved its claims before; never says ready
    assert "mallory" in host.members(host.planning.staged)
    host.leave("bob")  # an honest member restarts: the plan in use is broken, the new one goes out at once
    published, at = host.planning.plan, host.now
    assert "mallory" in host.members(published) and host.asker.plans[-1].version == published.version
    host.load(but="mallory")
    stage = published.stage_for("mallory")
    deadline = ready_deadline_s(SMOL.range_bytes(stage.start, stage.stop), host.planning.staging.settings.ready_deadline_s)
    while "mallory" in host.members() and host.now < at + 10 * deadline:
        host.wait(1.0)
    remade_after = host.now - at
    assert deadline <= remade_after <= deadline + 1.0, (remade_after, deadline)
    refused = host.trunks["mallory"].refused
    assert "was not ready" in refused and "left out of plans for" in refused
    assert "mallory" not in host.members(host.asker.plans[-1])
    host.serve()  # alice serves the model alone now


def test_a_member_that_keeps_missing_its_deadline_waits_longer_each_time_and_versions_are_never_reused(tmp_path):
    """A member that re-registers after each staged deadline kept a plan staged forever (every
    trunk reloading a standby each round), and a given-up staged plan's version came back (v7, v9
    twice). Now each miss leaves it out for MISSED_HOLD_S, doubling, also across its re-registrations,
    and no version is ever issued for two different plans, nor again by a restarted host."""
    host = Host(tmp_path, {"alice": 1.0, "bob": 1.0})
    host.planning.staging.settings.staged_deadline_s = 8.0
    host.serve()
    rounds = []  # (when, version) of each staged plan mallory is given to load

    def a_round() -> None:
        staged = host.planning.staged
        if staged is not None and "mallory" in host.members(staged):
            rounds.append((host.now, staged.version))

    host.join("mallory")
    a_round()
    while host.now < 4 * MISSED_HOLD_S:
        was_held, was_staged = bool(host.trunks["mallory"].refused), host.planning.staged is not None
        host.load(but="mallory")
        host.wait(1.0)
        if host.trunks["mallory"].refused and not was_held:  # it missed: it registers again at once
            host.leave("mallory")
            host.join("mallory")
            a_round()
            assert host.planning.staged is None and host.trunks["mallory"].refused
        elif not was_staged:
            a_round()
    versions = [v for _, v in rounds]
    assert versions == sorted(set(versions)), rounds  # never the same version twice
    assert [round(b - a) for (a, _), (b, _) in zip(rounds, rounds[1:])] == [8 + 300, 8 + 600], rounds
    assert all(len(assignments) == 1 for assignments in host.issued().values()), host.issued()
    assert host.planning.plan.complete and "mallory" not in host.members()
    last = max(host.issued())
    restarted = Host(tmp_path, {})  # the host restarts: it numbers on past every version it issued
    assert restarted.planning.plan.version > last
    restarted.join("alice")
    assert restarted.planning.plan.version > last + 1


def test_a_member_that_rejoins_right_after_leaving_is_planned_in_only_after_a_wait(tmp_path):
    """A member that leaves and rejoins within the settle period is planned in at once the first
    time (a restart after a crash is honest), but not at once the second time in a row (each turn
    of a flapping member re-planned the swarm); a third time it waits twice as long."""
    host = Host(tmp_path, {"alice": 1.0, "bob": 1.0})
    host.serve()
    host.join("carol")
    assert "carol" in host.members(host.planning.staged)
    host.wait(3.0)
    host.leave("carol")
    assert host.planning.staged is None
    host.wait(2.0)
    host.join("carol")  # a restart: back at once
    assert not host.trunks["carol"].refused and "carol" in host.members(host.planning.staged)
    host.wait(3.0)
    host.leave("carol")
    versions = set(host.issued())
    host.wait(2.0)
    host.join("carol")  # back 2 s after leaving, a second time: no new plan yet
    assert host.planning.staged is None and set(host.issued()) == versions
    assert host.trunks["carol"].refused.startswith("rejoined 2 s after leaving")
    host.wait(REJOIN_HOLD_S - 1)
    assert host.planning.staged is None
    host.wait(1.0)
    assert "carol" in host.members(host.planning.staged)  # its wait is over: staged, as a new member is
    host.leave("carol")
    host.join("carol")
    host.wait(2 * REJOIN_HOLD_S - 1)
    assert host.planning.staged is None
    host.wait(1.0)
    assert "carol" in host.members(host.planning.staged)


def test_a_member_the_others_cannot_do_without_is_planned_at_once_whatever_its_wait(tmp_path):
    """The damping never leaves the swarm unable to serve: with two members that both hold part of
    the model, one that restarts is planned again as soon as it is back."""
    host = Host(tmp_path, {"alice": 1.0, "bob": 1.0}, memory=0.35 * GB)  # (50 MB each past the reserve)
    assert sorted(host.members()) == ["alice", "bob"]
    host.serve()
    host.leave("bob")
    assert host.members() == []
    host.join("bob")
    assert sorted(host.members()) == ["alice", "bob"] and not host.trunks["bob"].refused


def test_links_claimed_bad_and_good_by_turns_replan_nothing(tmp_path):
    """A link flapping between 1 and 100 ms re-planned at each turn (3 plan switches in 11 s). Link
    changes go through the speeds' gate now: the gain never holds for SUSTAIN_S, nothing moves."""
    host, issued = flapping(tmp_path, int(SUSTAIN_S + SETTLE_S) * 2)
    assert issued == 0 and host.members() == ["alice"]


def test_a_link_that_stays_bad_replans_once_its_gain_held(tmp_path):
    (tmp_path / "a").mkdir()
    host, issued = flapping(tmp_path / "a", int(SUSTAIN_S) + 30, bad_until=float("inf"))
    assert issued == 1 and host.members() == ["bob"]

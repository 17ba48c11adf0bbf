"""Issue 43 item 5 and its partial items, on the host's planning code alone (no processes, the
keeper's clock in the script's hands, the scenarios of tests/test_make_before_break.py). Prints JSON.

    python benchmarks/bench_plan_damping.py [--flap-seconds 300]

- ``never_loads``: a proven member that never loads is in a plan the host had to publish at once
  (an honest member of the plan in use left); how long after that publication the plan is remade
  without it, against its deadline (plans/hysteresis.py ready_deadline_s, SWARMCTL_READY_DEADLINE_S).
- ``keeps_missing``: the same member, re-registering as soon as it is left out after each staged
  deadline (8 s here): the staged rounds it got in an hour, when, and their versions.
- ``link_flapping``: a trunk claims its link to the asker at 100 ms and 1 ms by turns each second,
  on a latency plan of two trunks: how many plans were issued meanwhile (issue 43: 3 plan switches
  in 11 s; the host before this change issued one at each turn: 11 in 11 s).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plans.hysteresis import ready_deadline_s  # noqa: E402
from harness.planning_host import SMOL, Host, flapping  # noqa: E402


def never_loads(tmp: Path) -> dict:
    host = Host(tmp, {"alice": 1.0, "bob": 1.0})
    host.serve()
    host.join("mallory")
    host.leave("bob")
    published, at = host.planning.plan, host.now
    host.load(but="mallory")
    stage = published.stage_for("mallory")
    while "mallory" in host.members() and host.now < at + 3600:
        host.wait(0.1, step=0.1)
    return {"deadline_s": round(ready_deadline_s(SMOL.range_bytes(stage.start, stage.stop),
                                                  host.planning.staging.settings.ready_deadline_s), 2),
            "remade_after_s": round(host.now - at, 2), "published": published.version,
            "remade": host.planning.plan.version, "left_out": host.trunks["mallory"].refused}


def keeps_missing(tmp: Path, seconds: float = 3600.0) -> dict:
    host = Host(tmp, {"alice": 1.0, "bob": 1.0})
    host.planning.staging.settings.staged_deadline_s = 8.0
    host.serve()
    host.join("mallory")
    rounds = [(0.0, host.planning.staged.version)]
    while host.now < seconds:
        was_held, was_staged = bool(host.trunks["mallory"].refused), host.planning.staged is not None
        host.load(but="mallory")
        host.wait(1.0)
        if host.trunks["mallory"].refused and not was_held:
            host.leave("mallory")
            host.join("mallory")
        elif not was_staged and host.planning.staged is not None:
            rounds.append((host.now, host.planning.staged.version))
    return {"seconds": seconds, "staged_rounds": len(rounds), "rounds_at_s": [t for t, _ in rounds],
            "versions": [v for _, v in rounds]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flap-seconds", type=int, default=300)
    args = parser.parse_args()
    logging.getLogger("swarmctl.host").setLevel(logging.ERROR)  # (the host's warnings of each scenario)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in ("a", "b", "c"):
            (root / name).mkdir()
        _, switches = flapping(root / "c", args.flap_seconds)
        print(json.dumps({"never_loads": never_loads(root / "a"), "keeps_missing": keeps_missing(root / "b"),
                          "link_flapping": {"seconds": args.flap_seconds, "plan_switches": switches}}, indent=1))


if __name__ == "__main__":
    main()

"""The host's watch on its member records (swarmctl/host/revocations.py), without a host: a change
that names a revoked certificate the host does not know of revokes it, once; other changes do
nothing. (A running host reading a revocation the CLI could not tell it: tests/test_swarm.py.)"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from swarmctl.host import revocations
from swarmctl.host.revocations import FileStamp, watch_revocations
from swarmctl.node.home import MemberRecord, SwarmHome


def write(path: Path, records: dict) -> None:
    """As the CLI writes them: a whole new file put in place."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(records))
    os.replace(tmp, path)


def save(home: SwarmHome, revoked: dict[str, bool]) -> None:
    """The host's member records: name -> revoked, serial i + 1 for the i-th name."""
    home.save_members({name: MemberRecord(name=name, serial=i + 1, fingerprint="00", joined_at=0.0, revoked=r)
                       for i, (name, r) in enumerate(revoked.items())})


def test_a_file_stamp_sees_a_new_file_a_replaced_one_and_nothing_else(tmp_path):
    path = tmp_path / "members.json"
    stamp = FileStamp(path)
    assert not stamp.changed()  # no file yet
    write(path, {})
    assert stamp.changed() and not stamp.changed()
    write(path, {"a": 1})
    assert stamp.changed() and not stamp.changed()
    assert FileStamp(path).changed()  # a watch that starts reads what is there once


def test_the_watch_revokes_what_the_host_does_not_know_once(tmp_path, monkeypatch):
    monkeypatch.setattr(revocations, "RECORDS_POLL_S", 0.01)
    home = SwarmHome(tmp_path)
    save(home, {"alice": True, "bob": False})
    known = {1}  # what the host's plan says (it read alice's revocation at start)
    calls: list[frozenset[int]] = []

    def revoke(serials: frozenset[int]) -> int:
        calls.append(serials)
        if len(calls) == 2:
            raise RuntimeError("a re-plan that failed")  # logged; the watch goes on, the next change retries
        known.update(serials)
        return 1

    async def run() -> None:
        watch = asyncio.ensure_future(watch_revocations(home, lambda: frozenset(known), revoke))
        await asyncio.sleep(0.05)
        assert calls == []  # the first look: nothing the host does not know
        save(home, {"alice": True, "bob": False, "carol": False})
        await asyncio.sleep(0.05)
        assert calls == []  # a member joined: no revocation
        save(home, {"alice": True, "bob": True, "carol": False})
        await asyncio.sleep(0.05)
        assert calls == [frozenset({1, 2})]  # bob's, with every revoked serial, once
        home.file("members.json").write_text("{damaged")  # written half-way: a warning, the watch goes on
        await asyncio.sleep(0.05)
        save(home, {"alice": True, "bob": True, "carol": False, "dave": True})
        await asyncio.sleep(0.05)
        assert calls[-1] == frozenset({1, 2, 4}) and len(calls) == 2  # (this one failed)
        save(home, {"alice": True, "bob": True, "carol": False, "dave": True, "erin": False})
        await asyncio.sleep(0.05)
        assert calls[-1] == frozenset({1, 2, 4}) and len(calls) == 3  # dave's, again
        assert not watch.done()
        watch.cancel()

    asyncio.run(run())

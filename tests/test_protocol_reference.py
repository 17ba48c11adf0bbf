"""docs/protocol.md is generated from net/messages.py and net/wire.py (issue 31 item 3): one source
of truth for the control messages, and this test fails when the page and the code differ."""

from __future__ import annotations

from pathlib import Path

from net import messages, reference

PAGE = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def test_the_protocol_page_is_what_the_code_says():
    assert PAGE.read_text() == reference.render(), \
        "docs/protocol.md differs from net/messages.py: run `python -m net.reference > docs/protocol.md`"


def test_every_message_is_on_the_page_with_its_fields_and_senders():
    page = reference.render()
    tags = {e.tag for e in reference.entries() if e.tag}
    assert {"join", "register", "plan", "reach", "prove", "stats"} <= tags
    for entry in reference.entries():
        for f in entry.fields:
            assert f"`{f.name}: " in page
    register = page[page.index("#### `register`"):page.index("#### `ready`")]
    assert "role is trunk" in register and "`memory: Memory`" in register
    assert "`ms_per_layer_token: MsPerLayer | None = None` — None: it has no model file" in register


def test_a_message_field_changed_in_code_changes_the_page(monkeypatch):
    """The reader follows the source: a field the page lacks makes the first test fail."""
    source = reference.inspect.getsource(messages)
    changed = source.replace("    relay: bool = False  # it offers to relay links (run --relay)\n",
                             "    relay: bool = False  # it offers to relay links (run --relay)\n    colour: Text = ''\n")
    assert changed != source
    monkeypatch.setattr(reference.inspect, "getsource", lambda obj: changed if obj is messages else source)
    assert "`colour: Text = ''`" in reference.render() != PAGE.read_text()

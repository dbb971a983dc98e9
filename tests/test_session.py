"""What visitors share and what they own (layerswap.ui.session), and how errors reach the page."""

from __future__ import annotations

import gradio as gr
import pytest

from layerswap import mgsm
from layerswap.engines import check_memory
from layerswap.errors import UserError
from layerswap.hosting import Policy
from layerswap.plans import Plan
from layerswap.recipes import Recipe
from layerswap.ui.events import guarded
from layerswap.ui import session
from layerswap.ui.session import Shared
from layerswap.workbench import Workbench
from tests.helpers import make_trio


@pytest.fixture()
def shared():
    s = Shared(lambda: Workbench(engine="transformers"), capacity=1)
    yield s
    s.close()


def test_failed_load_keeps_the_loaded_models(shared, trio, tmp_path, tokenizer):
    key = (str(trio["base"]), str(trio["math"]), str(trio["lang"]))
    wb = shared.workbench(key)
    other = make_trio(tmp_path / "eight", tokenizer, layers=8)  # another layer count: cannot be merged with trio
    with pytest.raises(UserError, match="layers"):
        shared.workbench((str(trio["base"]), str(trio["math"]), str(other["lang"])))
    assert shared.loaded(key) is wb and "math" in wb.engines  # still there and usable
    assert shared.ensure_built(wb, Recipe(plan=Plan(b=1, u=1))) is True
    assert shared.ensure_built(wb, Recipe(plan=Plan(b=1, u=1))) is False  # already holds that plan
    assert shared.ensure_built(wb, Recipe(plan=Plan(b=2, u=1))) is True  # another visitor's plan: rebuilt
    (a,) = wb.ask("Question: 1 + 1?", mgsm.get_language("en"), roles=("merged",), max_new_tokens=4)
    assert a.role == "merged"


def test_capacity_drops_the_oldest_trio_only_after_the_new_one_passed_its_checks(trio, tmp_path, tokenizer):
    s = Shared(lambda: Workbench(engine="transformers"), capacity=1)
    try:
        first = (str(trio["base"]), str(trio["math"]), str(trio["lang"]))
        s.workbench(first)
        second = make_trio(tmp_path / "second", tokenizer)
        s.workbench((str(second["base"]), str(second["math"]), str(second["lang"])))
        assert s.loaded(first) is None and len(s._wbs) == 1
    finally:
        s.close()


def test_visitors_come_from_the_server(shared, monkeypatch):
    """One visitor per session, with a server-made id naming its folder; no session: a fresh one each time."""
    a = shared.visitor("session-a", ("b", "m", "l"))
    assert shared.visitor("session-a") is a and a.refs == ("b", "m", "l")
    assert shared.visitor("session-b") is not a and shared.visitor(None) is not shared.visitor(None)
    assert len(a.sid) == 32 and "session" not in a.sid
    hostile = shared.visitor("../../etc/passwd" + "x" * 10_000)  # any hash: only its digest is kept
    d = shared.folder(hostile)
    assert d.parent == shared.root and d.name == hostile.sid
    assert not a.stop.is_set() and hostile.stop is not a.stop
    (d / "f").write_text("x")
    shared.end("../../etc/passwd" + "x" * 10_000)
    assert not d.exists() and hostile.stop.is_set()  # a closed tab's job stops, its files go


def test_visitors_are_bounded_and_busy_ones_stay(shared, monkeypatch):
    monkeypatch.setattr(session, "MAX_VISITORS", 3)
    first = shared.visitor("first")
    first.busy = 1  # a job is running for it
    d = shared.folder(shared.visitor("second"))
    for i in range(5):
        shared.visitor(f"other-{i}")
    assert len(shared._visitors) == 3 and shared.visitor("first") is first  # kept while busy
    assert not d.exists()  # the idle visitors seen longest ago went, with their folders


def test_memory_precheck_refuses_with_the_numbers():
    with pytest.raises(UserError, match=r"needs 931322\.6 GiB, more than the available RAM \(\d+\.\d GiB\)"):
        check_memory(10**15, "cpu", "the two experts")
    check_memory(1, "cpu", "a byte")


@pytest.mark.parametrize("exc, msg", [
    (MemoryError(), "Out of memory: the job was stopped"),
    (OSError(28, "No space left on device"), "A file operation failed (No space left on device)"),
    (UserError("Give the base too."), "Give the base too."),
    (ValueError("odd"), "Unexpected error (ValueError: odd)"),
])
def test_errors_become_readable_dialogs(exc, msg):
    def fail():
        raise exc

    with pytest.raises(gr.Error) as e:
        guarded(fail)()
    assert msg in str(e.value)


def test_hosted_errors_and_outputs_lose_server_paths():
    def fail():
        raise UserError("cannot read /srv/app/models/secret/config.json")

    with pytest.raises(gr.Error) as e:
        guarded(fail, Policy(hosted=True))()
    assert "/srv" not in str(e.value) and "config.json" in str(e.value)
    assert guarded(lambda: ["in /srv/app/x.bin", 3], Policy(hosted=True))() == ["in x.bin", 3]
    assert guarded(lambda: "in /srv/app/x.bin")() == "in /srv/app/x.bin"  # locally paths are useful

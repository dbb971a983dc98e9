"""What visitors share and what they own (layerswap.ui.session), and how errors reach the page."""

from __future__ import annotations

import gradio as gr
import pytest

from layerswap.evaluation import mgsm
from layerswap.engines import check_memory
from layerswap.core.errors import UserError
from layerswap.serving.hosting import Policy
from layerswap.recipe.plans import Plan
from layerswap.recipe.recipes import Recipe
from layerswap.ui.events import guarded
from layerswap.ui import session
from layerswap.ui.session import Shared
from layerswap.serving.workbench import Workbench
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
    assert shared.loaded(key) is wb and "math" in shared.engines(key).engines  # still there, its engines answer
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


def test_visitors_are_bounded_and_work_in_progress_stays(shared, monkeypatch):
    """Reproduction 4 (the table): fresh sessions drop only idle visitors; a visitor with a job running or
    queued, or a young export, stays with its folder; when all have work in progress a new one is refused."""
    import time

    from layerswap.ui.lane import Admission

    shared.visitors.capacity = 4
    first = shared.visitor("first")
    first.busy = 1  # a job is running for it
    queued = shared.visitor("queued")
    queued.job = Admission()  # admitted to the queue, not yet running
    exported = shared.visitor("exported")
    exported.last_export, exported.exported_at = "x", time.monotonic()
    d = shared.folder(shared.visitor("second"))
    for i in range(5):
        shared.visitor(f"other-{i}")
    assert len(shared.visitors) == 4 and not d.exists()  # the idle visitor seen longest ago went, with its folder
    assert all(shared.visitor(s) is v for s, v in (("first", first), ("queued", queued), ("exported", exported)))
    for v in (first, queued, exported):
        assert not v.stop.is_set() and not v.dropped
    shared.visitor("other-4").job = Admission()
    with pytest.raises(UserError, match="This server is full"):
        shared.visitor("one-too-many")


def test_a_tab_closed_during_its_job_leaves_no_folder(shared):
    """Reproduction 5 (orphans): the unload while a job runs drops the visitor when the job ends; its folder
    cannot be made again afterwards."""
    v = shared.visitor("closing")
    v.busy = 1
    d = shared.folder(v)
    shared.end("closing")
    assert d.exists() and v.stop.is_set() and not v.dropped  # the job ends first (it was told to stop)
    v.busy = 0
    shared.visitors.release(v)
    assert v.dropped and not d.exists()
    with pytest.raises(UserError, match="reload the page"):
        shared.folder(v)


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


def test_served_files_live_in_a_neutral_root_gone_at_exit(monkeypatch, tmp_path):
    """Reproduction 7 (file replies) and 5 (the app's own temp files): visitors' folders live in the served
    root, which is Gradio's cache (files served in place, a reply names only it) and is removed at exit."""
    import os

    from layerswap.ui.files import neutral_root

    monkeypatch.delenv("GRADIO_TEMP_DIR", raising=False)
    root = neutral_root()
    s = Shared(lambda: Workbench(engine="transformers"), root=root)
    try:
        assert os.environ["GRADIO_TEMP_DIR"] == str(root) and root.name.startswith("layerswap-files-")
        assert str(root).startswith("/tmp/") and str(tmp_path) not in str(root)
        d = s.folder(s.visitor("v"))
        assert d.parent == root
    finally:
        s.close()
    assert not root.exists() and "GRADIO_TEMP_DIR" not in os.environ


def test_disk_budgets_refuse_with_the_numbers(tmp_path):
    """Reproduction 5 (budgets): a visitor's folder, and all visitors' folders, within their budgets."""
    from layerswap.serving.hosting import Limits
    from layerswap.ui.files import Budget

    root, own = tmp_path / "root", tmp_path / "root" / "v"
    own.mkdir(parents=True)
    (own / "old").write_bytes(b"x" * 600)
    (root / "other").write_bytes(b"x" * 3000)
    budget = Budget(Limits(visitor_disk_bytes=1000, disk_bytes=5000))
    budget.check(300, own, root)
    with pytest.raises(UserError, match="per visitor"):
        budget.check(500, own, root)
    with pytest.raises(UserError, match="disk for visitors' files is full"):
        Budget(Limits(visitor_disk_bytes=10**6, disk_bytes=4000)).check(500, own, root)


def test_old_exports_go_when_their_ttl_passed(shared):
    import time

    v = shared.visitor("exporter")
    export = shared.folder(v) / "layerswap-merge"
    export.mkdir()
    v.last_export, v.exported_at = str(export), time.monotonic()
    shared.visitors.expire_exports()
    assert export.exists() and shared.visitors.protected(v)
    v.exported_at -= shared.visitors.export_ttl
    shared.visitors.expire_exports()
    assert not export.exists() and v.last_export is None and not shared.visitors.protected(v)


def test_start_up_work_behind_the_page_yields_the_cores(trio):
    """The background start and the engines it starts run at a lower CPU priority than the page's events (their
    threads' own nice value, on Linux); the threads serving visitors keep theirs."""
    import os
    import threading

    from layerswap.core.runtime import BACKGROUND_NICENESS

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    own, seen = nice(), {}
    s = Shared(lambda: Workbench(engine="transformers"), capacity=1)
    try:
        key = (str(trio["base"]), str(trio["math"]), str(trio["lang"]))
        s.start_background(key, after=lambda wb: seen.setdefault("engines", nice())).join(120)
        assert s.engines(key).answering
        assert seen["engines"] >= BACKGROUND_NICENESS  # (a test run niced already keeps its own, higher)
        assert nice() == own
    finally:
        s.close()


def test_a_familys_export_goes_when_its_ttl_passed(shared):
    import time

    from layerswap.ui.visitors import FAMILY_FILES

    v = shared.visitor("family exporter")
    made = [shared.folder(v) / name for name in FAMILY_FILES]
    for p in made:
        p.mkdir()
    v.family_exported_at = time.monotonic()
    shared.visitors.expire_exports()
    assert all(p.exists() for p in made) and shared.visitors.protected(v)
    v.family_exported_at -= shared.visitors.export_ttl
    shared.visitors.expire_exports()
    assert not any(p.exists() for p in made) and v.family_exported_at == 0 and not shared.visitors.protected(v)

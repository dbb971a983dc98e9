"""The hosted app against hostile callers, as strangers reach it: through the Gradio API.

- Identity: two API clients with no browser tab cannot see, stop or overwrite each other's work.
- Bounds: a short field that would expand into a huge allocation is refused from its text.
- Gated and private Hub models are refused from the Hub's metadata, before any download or cache lookup.
- The harness: every `api_name` of the launched hosted app (discovered from the app itself, so a new
  event is covered without editing this file) is called with hostile values of each parameter's type.
  Each call ends in a readable refusal or a normal answer within a bounded time, the server's memory
  stays within `RSS_GROWTH_MB`, nothing is written outside the visitor's own folder, and the app still
  answers a normal request afterwards.
"""

from __future__ import annotations

import math
import re
import time
import tracemalloc
from pathlib import Path

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from layerswap.core.errors import UserError
from layerswap.engines import EngineSettings
from layerswap.serving.hosting import Limits, Policy
from tests.helpers import APPS, JsonHandler, free_port, launch_app, serve

PLAN = (1, 0, 0, 0, "flat", 0.5, "neighbour", "swap", "", 4, 0, 0, "all", "layer_swap", 0.5, 1.0, 0.2, 0.9, "1,1", "")
MARK = "lsx-evil"  # in every path-like hostile value: no file or folder of that name may appear anywhere
RSS_GROWTH_MB = 400  # the server's peak resident memory over its size after the warm-up (measured: +206 MB)
CALL_SECONDS = 45  # a call that runs longer is stopped with the caller's Stop; it must then end within this too


# ---- a fake Hub on loopback: public, gated and private models ------------------------------------------------

class FakeHub(JsonHandler):
    """The Hub's model-info endpoint; `seen` records every path asked for (a file download would show here)."""

    seen: list = []
    MODELS = {"public/model": {}, "gated/model": {"gated": "auto"}, "private/model": {"private": True}}

    def do_GET(self):  # noqa: N802 (http.server's name)
        FakeHub.seen.append(self.path)
        m = re.match(r"/api/models/([^/]+/[^/?]+)", self.path)
        if m is None or m.group(1) not in self.MODELS:
            self.send_response(404)
            self.end_headers()
            return
        repo = m.group(1)
        self.reply({"id": repo, "modelId": repo, "sha": "b" * 40, "private": False, "gated": False,
                    **self.MODELS[repo], "siblings": [{"rfilename": "config.json", "size": 100},
                                                      {"rfilename": "model.safetensors", "size": 1000}]})


@pytest.fixture(scope="module")
def fake_hub():
    yield from serve(FakeHub)


@pytest.fixture
def on_fake_hub(fake_hub, monkeypatch, tmp_path):
    import huggingface_hub.constants as c

    from layerswap.models.hub import hub_reachable

    monkeypatch.setenv("HF_ENDPOINT", fake_hub)
    monkeypatch.setattr(c, "ENDPOINT", fake_hub)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hub_reachable.cache_clear()
    FakeHub.seen.clear()
    yield tmp_path / "hub"
    hub_reachable.cache_clear()


@pytest.mark.parametrize("repo,why", [("gated/model", "gated"), ("private/model", "private")])
def test_gated_and_private_models_are_refused_before_any_download_or_cache_lookup(on_fake_hub, repo, why):
    from layerswap.serving.hosting import fetch

    # the server's cache already holds the model (downloaded earlier with the owner's token)
    snap = on_fake_hub / f"models--{repo.replace('/', '--')}" / "snapshots" / ("b" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"x")
    ref_dir = on_fake_hub / f"models--{repo.replace('/', '--')}" / "refs"
    ref_dir.mkdir()
    (ref_dir / "main").write_text("b" * 40)
    with pytest.raises(UserError, match=why):
        fetch(repo, Limits())
    assert FakeHub.seen and all(p.startswith(f"/api/models/{repo}") for p in FakeHub.seen)  # metadata only


def test_a_public_model_passes_the_metadata_check(on_fake_hub):
    from layerswap.serving.hosting import plan_download

    assert plan_download("public/model", Limits()).total == 1100


# ---- bounds: a short field never expands into a huge allocation ---------------------------------------------

def _peak_mb(fn) -> tuple[float, float]:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak / 1e6, time.perf_counter() - t0


@pytest.mark.parametrize("field,text", [("revert", "0-10000000"), ("revert", "0-2000000000"), ("revert", "5-" + "9" * 40),
                                        ("layer_weights", "0," * 500_000)])
def test_huge_layer_specs_are_refused_from_their_text(field, text):
    """What `/preview` and a shared link (`?revert=...`) run: refused without building the list."""
    from layerswap.ui.controls import recipe

    values = list(PLAN)
    values[19 if field == "revert" else 8] = text
    if field == "layer_weights":
        values[7] = "weights"

    def call():
        with pytest.raises(UserError):
            recipe(*values)

    peak, seconds = _peak_mb(call)
    assert peak < 20 and seconds < 1, (peak, seconds)


def test_oversized_ranges_are_refused_everywhere():
    from layerswap.recipe.plans import parse_layers

    assert parse_layers("0-2,7") == (0, 1, 2, 7)
    with pytest.raises(UserError, match="layers"):
        parse_layers("0-2000000000")
    with pytest.raises(UserError, match="layers"):
        parse_layers(list(range(100_000)))


# ---- identity: API callers with no browser tab ----------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The hosted app in this process (so a test can stand in for the Hub at the push boundary)."""
    from layerswap.shipped.demo import demo_mgsm_dir, demo_refs
    from layerswap.ui.app import AppDefaults, create_app

    refs, label, summary, plan = demo_refs()
    policy = Policy(hosted=True, limits=Limits(eval_questions=400))
    demo, app = create_app(AppDefaults(math=refs["math"], lang=refs["lang"], base=refs["base"], label=label,
                                       plan=plan, mgsm_dir=str(demo_mgsm_dir()),
                                       engine=EngineSettings(engine="transformers", device="cpu"), policy=policy))
    port = free_port()
    demo.queue(default_concurrency_limit=1).launch(server_port=port, prevent_thread_lock=True, quiet=True, show_error=True)
    app.start_loading()
    app.shared.ready.wait(300)
    app.demo = demo
    yield f"http://127.0.0.1:{port}", app
    demo.close()
    app.shared.close()


def test_api_callers_cannot_stop_each_other(served):
    url, _ = served
    a, b = Client(url, verbose=False), Client(url, verbose=False)
    a.predict(*PLAN, api_name="/build")  # A has used the app before, as any API user has
    job = b.submit(["xx"], ["math", "lang", "merged"], 150, 0, "native_cot", 48, *PLAN, api_name="/evaluate")
    deadline = time.time() + 60
    while time.time() < deadline and job.status().code.name not in ("PROCESSING", "PROGRESS", "FINISHED"):
        time.sleep(0.2)
    time.sleep(1.0)  # B's evaluation is under way
    assert not job.done(), "B's evaluation ended before A could press Stop: make it longer"
    for stop in ("/stop", "/stop_eval", "/stop_sweep"):
        a.predict(api_name=stop)
    status = job.result(timeout=600)[0]
    assert status.startswith("**Done:** 450 answers"), status


def test_api_callers_do_not_overwrite_each_others_export(served, monkeypatch):
    """A exports, B exports: A's Push uploads A's merge, not B's."""
    import layerswap.merge.publish as publish

    url, _ = served
    a, b = Client(url, verbose=False), Client(url, verbose=False)
    a.predict("", False, *PLAN, api_name="/export")
    b_plan = (3, 1, 1, 1, *PLAN[4:])
    b.predict("", False, *b_plan, api_name="/export")
    pushed = {}

    def fake_push(folder, repo_id, *, token, **kw):  # the boundary: which folder would reach the Hub
        pushed["card"] = (Path(folder) / "README.md").read_text()
        raise UserError("stopped at the boundary")

    monkeypatch.setattr(publish, "push", fake_push)
    with pytest.raises(AppError, match="stopped at the boundary"):
        a.predict("me/merge", True, "hf_visitor_a", api_name="/push")
    assert "b=1 u=0 tb=0 tu=0" in pushed["card"] and "b=3" not in pushed["card"]
    c = Client(url, verbose=False)  # a caller that exported nothing has nothing to push
    with pytest.raises(AppError, match="Export the merged model first"):
        c.predict("me/merge", True, "hf_visitor_c", api_name="/push")


def test_each_api_caller_gets_its_own_folder(served):
    url, app = served
    a, b = Client(url, verbose=False), Client(url, verbose=False)
    ya = a.predict(*PLAN, api_name="/export_yaml")
    yb = b.predict(*PLAN, api_name="/export_yaml")
    assert ya["value"] and yb["value"]
    folders = [p for p in app.shared.root.iterdir() if (p / "layerswap-mergekit.yml").exists()]
    assert len(folders) >= 2 and not any(p.name == "anonymous" for p in app.shared.root.iterdir())
    assert all(len(p.name) >= 22 for p in folders)  # server-made, unguessable ids


def test_every_event_resolves_its_caller_on_the_server(served):
    """Every registered event goes through `ui.events.event` (identity from the session), and no public
    endpoint called by A changes what B has: B's models, export, evaluation, Stop flag and folder."""
    url, app = served
    demo = app.demo
    named = [f for f in demo.fns.values() if f.fn is not None and f.name != "<lambda>"  # a constant status line
             and not any(t[1] == "unload" for t in f.targets)]  # the tab closed: `Shared.end` of its session
    assert named and all(getattr(f.fn, "layerswap_event", False) for f in named), \
        [f.name for f in named if not getattr(f.fn, "layerswap_event", False)]
    a, b = Client(url, verbose=False), Client(url, verbose=False)
    b.predict(*PLAN, api_name="/build")
    b.predict("", False, *PLAN, api_name="/export")
    b.predict(["xx"], ["math"], 2, 0, "native_cot", 16, *PLAN, api_name="/evaluate")
    vb = app.shared.visitor(b.session_hash)
    folder = app.shared.folder(vb)

    def state():
        return (vb.refs, vb.last_export, id(vb.last_eval), vb.stop.is_set(),
                sorted((str(p), p.stat().st_mtime_ns) for p in folder.rglob("*")))

    before = state()
    api = a.view_api(print_info=False, return_format="dict")["named_endpoints"]
    for name, ep in api.items():
        if name == "/sweep":  # runs minutes; its folder and Stop are the ones the other events use
            continue
        try:
            a.predict(*_normal(name, ep["parameters"]), api_name=name)
        except AppError:
            pass
        assert state() == before, f"A's {name} changed B's state"
    assert app.shared.visitor(a.session_hash) is not vb


# ---- the harness -----------------------------------------------------------------------------------------------

HOSTILE = {
    "str": ["x" * 1_000_000, f"../../{MARK}/../x", "/etc/passwd", f"~/{MARK}", f"file:///tmp/{MARK}",
            "\x00\x1b[31m\u202e\ufffe\U0001F4A5", "0-1000000000000", "nan", {"a": 1}, 12345, None],
    "number": [1e308, -1e308, math.nan, math.inf, -1, 2**63, 10**12, 0.5, "12abc", [1, 2], None],
    "bool": ["yes", 2, None],
    "list": [["x" * 1000] * 1000, "notalist", [None], [], [f"../{MARK}"]],
    "choice": ["not-a-choice", 10**12, None, f"../../{MARK}"],
}


def _kind(param: dict) -> str:
    t = param["python_type"]["type"]
    if t.startswith("list"):
        return "list"
    if t.startswith("Literal"):
        return "choice"
    if t in ("float", "int"):
        return "number"
    return "bool" if t == "bool" else "str"


def _normal(name: str, params: list[dict]) -> list:
    """Cheap but valid arguments: the page's defaults, with short answers and small evaluations."""
    small = {("/ask", "max_new_tokens"): 16, ("/evaluate", "limit"): 2, ("/evaluate", "max_new"): 16,
             ("/sweep", "limit"): 1, ("/sweep_results", "limit"): 1, ("/ask", "free_text"): "",
             ("/push", "repo_id"): "me/merge", ("/push", "token_text"): ""}
    return [small.get((name, p["parameter_name"]), p.get("parameter_default")) for p in params]


def _rss(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(field)


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


@pytest.fixture(scope="module")
def hostile_app(tmp_path_factory, fake_hub):
    work = tmp_path_factory.mktemp("hostile")
    for d in ("tmp", "home", "gradio", "hf"):
        (work / d).mkdir()
    env = {"LAYERSWAP_HOSTED": "1", "HF_ENDPOINT": fake_hub, "HF_TOKEN": "hf_owner_secret_token",
           "LAYERSWAP_MAX_EVAL_QUESTIONS": "5", "TMPDIR": str(work / "tmp"), "HOME": str(work / "home"),
           "GRADIO_TEMP_DIR": str(work / "gradio"), "HF_HOME": str(work / "hf")}
    yield from ((url, work) for url in launch_app(work, mgsm_dir=None, env_extra=env))


def test_every_endpoint_survives_hostile_values(hostile_app):
    url, work = hostile_app
    pid = APPS[url].pid
    api = Client(url, verbose=False).view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert {"/load", "/build", "/ask", "/export", "/evaluate", "/heatmap", "/sweep", "/push"} <= set(api)
    warm = Client(url, verbose=False)  # warm-up: models loaded, a merge built, the analysis computed
    warm.predict(*_normal("/heatmap", api["/heatmap"]["parameters"]), api_name="/heatmap")
    warm.predict(*_normal("/ask", api["/ask"]["parameters"]), api_name="/ask")
    base_rss = _rss(pid)
    before = _files(work)
    findings: list[str] = []
    calls, t0, slowest, per_endpoint = 0, time.perf_counter(), (0.0, ""), {}
    # one client, a fresh session per call (what a new caller is to the server): a Client per call fetched the
    # config and the API schema again and left a heartbeat stream open on the server for each of ~500 calls
    c = Client(url, verbose=False)
    for name, ep in api.items():
        params = ep["parameters"]
        cases = [None] if not params else []
        for i, p in enumerate(params):
            values = HOSTILE[_kind(p)]
            # two values per parameter, rotating through the type's list (four on the cheap plan-only endpoint)
            chosen = [values[(i + j) % len(values)] for j in ((0, 1, 2, 3) if name == "/preview" else (0, calls % 3 + 1))]
            cases += [(i, v) for v in chosen]
        for case in cases:
            args = _normal(name, params)
            if case is not None:
                args[case[0]] = case[1]
            c.reset_session()
            calls += 1
            start = time.perf_counter()
            job = c.submit(*args, api_name=name)
            try:
                job.result(timeout=CALL_SECONDS)
            except TimeoutError:
                c.predict(api_name="/stop")  # the caller's own Stop ends a long legitimate job
                try:
                    job.result(timeout=CALL_SECONDS)
                except TimeoutError:
                    findings.append(f"{name} {case}: still running {2 * CALL_SECONDS} s after Stop")
                except Exception:
                    pass
            except AppError as e:
                msg = str(e)
                if not msg.strip() or "Unexpected error" in msg or "verbose error reporting" in msg:
                    findings.append(f"{name} arg {case and case[0]}={str(case and case[1])[:40]!r}: {msg[:200]}")
                if str(work) in msg or "layerswap-sessions" in msg:
                    findings.append(f"{name}: a server path in the message: {msg[:200]}")
            except Exception as e:  # the framework refused the value before the app saw it (e.g. not JSON)
                if "Connection" in type(e).__name__:
                    findings.append(f"{name} {case}: the server stopped answering ({type(e).__name__})")
            took = time.perf_counter() - start
            slowest = max(slowest, (took, name))
            per_endpoint[name] = per_endpoint.get(name, 0.0) + took
    total = time.perf_counter() - t0
    peak = _rss(pid, "VmHWM")
    # nothing written outside a visitor's own folder (sessions root), Gradio's file cache, the analysis cache
    allowed = [work / "tmp", work / "gradio", work / "cache", work / "hf", work / "app.log"]
    new = [p for p in _files(work) - before if not any(p == a or a in p.parents for a in allowed)]
    sessions = [d for d in (work / "tmp").iterdir() if d.name.startswith("layerswap-sessions-")]
    stray = [p for p in (work / "tmp").rglob("*") if not any(s == p or s in p.parents for s in sessions)
             and not p.name.startswith(("gradio", "tmp", "pymp-", "torchinductor"))]
    marked = [p for root in (work.parent, Path("/tmp"), work) for p in root.rglob(f"*{MARK}*")]
    growth = peak - base_rss
    print(f"\nhostile harness: {calls} calls to {len(api)} endpoints in {total:.0f} s (slowest {slowest[0]:.1f} s, "
          f"{slowest[1]}); server RSS {base_rss:.0f} MB after warm-up, peak {peak:.0f} MB (+{growth:.0f} MB); "
          f"seconds per endpoint: {', '.join(f'{k} {v:.0f}' for k, v in sorted(per_endpoint.items(), key=lambda x: -x[1]))}")
    assert not findings, "\n".join(findings)
    assert not new and not marked, (new, marked)
    assert not [p for p in stray if p.is_file() and MARK in str(p)]
    assert growth < RSS_GROWTH_MB, f"peak RSS grew {growth:.0f} MB"
    # and a normal request still works
    out = Client(url, verbose=False).predict(*_normal("/build", api["/build"]["parameters"]), api_name="/build")
    assert "Built" in out[1]


@pytest.mark.parametrize("value", [math.nan, math.inf, -1, 9, 2.5, "12abc", None, [1], True, "1e400"])
def test_whole_numbers_are_refused_unless_finite_whole_and_in_range(value):
    from layerswap.core.errors import whole_number

    with pytest.raises(UserError, match="whole number from 0 to 8"):
        whole_number(value, "x", 0, 8)
    assert whole_number(3.0, "x", 0, 8) == 3 and whole_number("7", "x", 0, 8) == 7

"""Hosted mode through the Gradio API, as a stranger would use it: no server paths in or out, writes only
in the visitor's own folder, size-checked token-free downloads, no state shared between visitors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from layerswap.core.errors import UserError
from layerswap.serving.hosting import Limits, Policy, hosted_from_env, plan_download, scrub_paths
from tests.helpers import JsonHandler, launch_app, serve

SIZES = {"config.json": 700, "tokenizer.json": 9_000_000, "model-00001-of-00002.safetensors": 60 * 10**9,
         "model-00002-of-00002.safetensors": 40 * 10**9, "README.md": 5000, "pytorch_model.bin": 10**9}


class FakeHub(JsonHandler):
    """The Hub's model-info endpoint on loopback: a 100 GB model; records the Authorization headers it saw."""

    seen: list = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        FakeHub.seen.append((self.path, self.headers.get("Authorization")))
        self.reply({"id": "big/model", "modelId": "big/model", "sha": "a" * 40, "private": False,
                    "siblings": [{"rfilename": n, "size": s} for n, s in SIZES.items()]})


@pytest.fixture(scope="module")
def fake_hub():
    yield from serve(FakeHub)


@pytest.fixture(scope="module")
def hosted_url(tmp_path_factory, fake_hub):
    env = {"LAYERSWAP_HOSTED": "1", "HF_ENDPOINT": fake_hub, "HF_TOKEN": "hf_owner_secret_token",
           "LAYERSWAP_MAX_DOWNLOAD_BYTES": str(50 * 10**9), "LAYERSWAP_MAX_EVAL_QUESTIONS": "5"}
    yield from launch_app(tmp_path_factory.mktemp("hosted"), mgsm_dir=None, env_extra=env)


def test_policy_rules():
    assert hosted_from_env({"SPACE_ID": "me/space"}) and not hosted_from_env({"SPACE_ID": "x", "LAYERSWAP_HOSTED": "0"})
    assert hosted_from_env({"LAYERSWAP_HOSTED": "1"}) and not hosted_from_env({})
    pol = Policy(hosted=True, allowlist=frozenset({"ok/model"}))
    assert pol.check_ref("ok/model@main") == "ok/model@main" and pol.check_ref("assets:demo/math")
    for bad in ("/etc", "../assets/demo/math", "~/models", "./x", "a/b/c"):
        with pytest.raises(UserError, match="Hub id"):
            pol.check_ref(bad)
    with pytest.raises(UserError, match="not on this server's list"):
        pol.check_ref("other/model")
    assert Policy().check_ref("/any/local/folder") == "/any/local/folder"  # a local research tool: anything
    assert scrub_paths("at /srv/app/assets/demo/math: 12 / 3 and https://hf.co/a/b") == "at math: 12 / 3 and https://hf.co/a/b"


def test_a_hub_like_name_of_a_server_folder_is_refused(tmp_path, monkeypatch):
    (tmp_path / "exports" / "merge").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # 'exports/merge' is both a valid Hub id and a folder here
    with pytest.raises(UserError, match="does not open folders"):
        Policy(hosted=True).check_ref("exports/merge")
    assert Policy(hosted=True).check_ref("other/merge") == "other/merge"


def test_an_adapters_own_base_is_checked_like_a_visitors_ref(tmp_path, monkeypatch):
    """A public adapter whose config names a server folder as its base: refused before anything opens it."""
    import layerswap.serving.hosting as hosting

    adapter = tmp_path / "snapshot"
    adapter.mkdir()
    fetched = []

    def fake_fetch(ref, limits, **kw):
        fetched.append(ref)
        return adapter

    monkeypatch.setattr(hosting, "fetch", fake_fetch)
    pol = Policy(hosted=True)
    for own in ("/srv/private-model", "../models/x"):
        (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": own}))
        with pytest.raises(UserError, match="base model named by the adapter some/adapter must be a .*Hub id"):
            hosting.fetch_models(pol, ("", "some/adapter", "assets:demo/lang"))
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "public/base"}))
    fetched.clear()
    hosting.fetch_models(pol, ("", "some/adapter", "assets:demo/lang"))
    assert fetched == ["some/adapter", "public/base"]  # the adapter's base goes through the same checks
    fetched.clear()
    hosting.fetch_models(pol, ("given/base", "some/adapter", "assets:demo/lang"), "given/base")
    assert fetched == ["given/base", "some/adapter"]  # a base the visitor gave replaces the adapter's own


def test_a_shared_link_goes_through_the_download_checks(fake_hub, monkeypatch):
    """Models named in a page link (not loaded with Load) are size-checked before anything downloads them."""
    monkeypatch.setenv("HF_ENDPOINT", fake_hub)
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "ENDPOINT", fake_hub)
    from layerswap.models.hub import hub_reachable
    from layerswap.ui.context import AppDefaults, Context
    from layerswap.ui.events import Job
    from layerswap.ui.session import Visitor

    hub_reachable.cache_clear()
    app = Context(AppDefaults(math="assets:demo/math", lang="assets:demo/lang", base="assets:demo/base",
                          policy=Policy(hosted=True, limits=Limits(download_bytes=50 * 10**9))))
    visitor = Visitor(refs=("", "big/model", "assets:demo/lang"))  # as `open_page` sets it from ?math=big/model
    with pytest.raises(UserError, match="more than this server's download cap"):
        app.workbench(Job(visitor, lambda *a, **k: None))
    hub_reachable.cache_clear()


def test_download_is_size_checked_without_a_token(fake_hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", fake_hub)
    monkeypatch.setenv("HF_TOKEN", "hf_owner_secret_token")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "ENDPOINT", fake_hub)
    from layerswap.models.hub import hub_reachable

    hub_reachable.cache_clear()
    FakeHub.seen.clear()
    with pytest.raises(UserError, match=r"100\.01 GB, more than this server's download cap \(50\.00 GB\)"):
        plan_download("big/model", Limits(download_bytes=50 * 10**9))
    assert FakeHub.seen and all(auth is None for _, auth in FakeHub.seen)  # the owner's token never went out
    hub_reachable.cache_clear()


def test_visitor_cannot_name_server_paths(hosted_url):
    c = Client(hosted_url, verbose=False)
    for ref in ("/etc", "../../etc", "assets:../../..", "/root/.cache/huggingface"):
        with pytest.raises(AppError) as e:
            c.predict("", ref, "assets:demo/lang", api_name="/load")
        assert not any(p in str(e.value) for p in ("/work", "/root", "/tmp", "/srv", "/home"))


def test_oversized_download_refused_and_no_token(hosted_url):
    c = Client(hosted_url, verbose=False)
    FakeHub.seen.clear()
    with pytest.raises(AppError, match="more than this server's download cap"):
        c.predict("", "big/model", "assets:demo/lang", api_name="/load")


def test_export_stays_in_the_visitors_folder(hosted_url, tmp_path):
    c = Client(hosted_url, verbose=False)
    target = tmp_path / "evil"
    msg, dl = c.predict(str(target), True, 1, 1, 0, 0, api_name="/export")
    assert "Wrote layerswap-merge" in msg and not target.exists()
    assert not any(p in msg for p in ("/tmp", "/work", "/root"))
    assert dl["visible"] and Path(dl["value"]).name == "layerswap-merge.zip"
    yml = c.predict(1, 1, 0, 0, api_name="/export_yaml")
    text = Path(yml["value"]).read_text()
    assert "merge_method" in text and not any(p in text for p in ("/work", "/root", "/tmp", "/srv", "/home"))


def test_visitors_do_not_share_state(hosted_url):
    a, b = Client(hosted_url, verbose=False), Client(hosted_url, verbose=False)
    pa, *_ = a.predict("xx", 0, "", 16, 1, 0, 0, 0, api_name="/ask")
    pb, *_ = b.predict("xx", 0, "", 16, 3, 1, 1, 1, api_name="/ask")
    pa2, *_ = a.predict("xx", 0, "", 16, 1, 0, 0, 0, api_name="/ask")
    assert "answers from swap b=1 u=0 tb=0 tu=0" in pa and "answers from swap b=1 u=0 tb=0 tu=0" in pa2
    assert "answers from swap b=3 u=1 tb=1 tu=1" in pb
    a.predict(["xx"], ["math"], 2, api_name="/evaluate")
    assert "xx question" in a.predict("xx", 0, api_name="/browse")
    assert b.predict("xx", 0, api_name="/browse") == "Run an evaluation to browse its questions."
    with pytest.raises(AppError, match="up to 5 questions per language"):
        b.predict(["xx"], ["math"], 0, api_name="/evaluate")
    with pytest.raises(AppError, match="characters; this server takes up to 2,000"):
        b.predict("xx", 0, "x" * 2001, 16, api_name="/ask")


def test_push_needs_the_visitors_own_token(hosted_url):
    """The server has HF_TOKEN set; a visitor without a token of their own is refused, never pushed with it."""
    c = Client(hosted_url, verbose=False)
    c.predict("", False, 1, 1, 0, 0, api_name="/export")
    with pytest.raises(AppError, match="Give your own Hub token"):
        c.predict("me/merge", True, "", api_name="/push")


def test_push_on_a_space_uses_only_the_login(monkeypatch):
    """On a Space the visitor's OAuth token is the only one: no login, no push (HF_TOKEN of the owner set)."""
    import gradio as gr

    from layerswap.ui.context import AppDefaults, Context
    from layerswap.ui.events import Job
    from layerswap.ui.session import Visitor
    from layerswap.ui.tabs.push import push

    monkeypatch.setenv("SPACE_ID", "owner/space")
    monkeypatch.setenv("HF_TOKEN", "hf_owner_secret_token")
    app = Context(AppDefaults(policy=Policy(hosted=True)))
    v = Job(Visitor(last_export="/nonexistent-export"), lambda *a, **k: None)
    with pytest.raises(UserError, match="Log in with your Hugging Face account first"):
        push(app, v, "me/merge", True, "hf_pasted_token_is_ignored_on_spaces", None)
    seen = {}
    import layerswap.merge.publish as publish

    def fake_push(folder, repo_id, *, token, **kw):  # the boundary: which token would reach the Hub
        seen["token"] = token
        raise UserError("stop here")

    monkeypatch.setattr(publish, "push", fake_push)
    with pytest.raises(UserError, match="stop here"):
        push(app, v, "me/merge", True, "", gr.OAuthToken(token="hf_visitor", scope="write-repos", expires_at=0))
    assert seen["token"] == "hf_visitor"


def _doc_table(header: str) -> list[tuple[str, ...]]:
    """The rows of docs/hosting.md's table under `header` (its cells, stripped)."""
    lines = (Path(__file__).resolve().parent.parent / "docs" / "hosting.md").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip() == header)
    rows = []
    for line in lines[at + 2:]:
        if not line.strip().startswith("|"):
            break
        rows.append(tuple(c.strip() for c in line.strip().strip("|").split("|")))
    return rows


def test_the_hosted_numbers_live_in_one_table_the_docs_state():
    """docs/hosting.md's limits are `Limits.table()` (the launch flag the app reads besides them follows), its time
    limits `JOB_SECONDS`; the visitor table, the export's lifetime and the lane read them; the page states them."""
    import re

    from layerswap.serving.hosting import DEFAULT_JOB_SECONDS, JOB_SECONDS
    from layerswap.ui import launch, lane, visitors

    rows = _doc_table("| variable | default | what |")
    assert rows[:len(Limits.table())] == Limits.table()
    launch_src = Path(launch.__file__).read_text()
    for var, _, _ in rows[len(Limits.table()):]:  # the app's own flags (the queue): read by launch, not a Limits cap
        assert re.fullmatch(r"`LAYERSWAP_\w+`", var) and var.strip("`") in launch_src, var
    minutes = sorted({s // 60 for s in (*JOB_SECONDS.values(), DEFAULT_JOB_SECONDS)})
    assert _doc_table("| minutes | jobs |") == [
        (str(m), ", ".join([f"`{k}`" for k, s in JOB_SECONDS.items() if s // 60 == m]
                           + (["any other"] if DEFAULT_JOB_SECONDS // 60 == m else []))) for m in minutes]
    assert lane.time_limit("evaluate") == JOB_SECONDS["evaluate"] and lane.time_limit("other") == DEFAULT_JOB_SECONDS
    assert (visitors.MAX_VISITORS, visitors.EXPORT_TTL) == (Limits.visitors, Limits.export_seconds)
    assert not re.search(r"\b512\b", launch_src) and "SECONDS = {" not in Path(lane.__file__).read_text()
    env = Limits.from_env({"LAYERSWAP_MAX_SEARCH_PLANS": "7", "LAYERSWAP_MAX_VISITORS": "9"})
    assert (env.search_plans, env.visitors, env.ref_chars) == (7, 9, 200)
    page = Limits().markdown()
    assert "plan searches up to 40 plans" in page and "kept 60 minutes" in page and "5 to 60 minutes" in page


def test_the_sweep_cap_counts_every_evaluation_a_family_included():
    """`SweepSpec.evaluations` is what the runner evaluates (`records.units_of` on the opened experts, a separate
    count), a family's once per language; the hosted cap refuses past it, naming the count, and every shipped
    sweep fits the default (the hosted page offers them all)."""
    from layerswap.sweeps import load_spec
    from layerswap.sweeps.records import open_set, units_of
    from layerswap.ui.tabs.sweeps import shipped_sweeps

    compared = []
    for name, path in shipped_sweeps().items():
        spec = load_spec(path)
        Policy(hosted=True).check_sweep(spec.evaluations(), 10)
        if spec.missing():  # experts its `build:` makes: nothing to open here
            continue
        left: dict = {}
        units = [u for s in spec.expert_sets for u in units_of(spec, s, open_set(s), left) if u.kind != "stats"]
        if left:  # grid points these experts' layers cannot take: dropped after opening, so a bound
            assert spec.evaluations() > len(units), name
        else:
            assert spec.evaluations() == len(units), name
        compared.append(name)
    assert "7-family.yaml" in compared
    family = load_spec(shipped_sweeps()["7-family.yaml"])
    assert len(family.expert_sets) == 3 and family.evaluations() == 3 * (len(family.points) + 2)
    tight = Policy(hosted=True, limits=Limits(sweep_points=family.evaluations() - 1))
    with pytest.raises(UserError, match=f"asks for {family.evaluations()} evaluations.*runs up to"):
        tight.check_sweep(family.evaluations(), 10)
    Policy(hosted=False, limits=Limits(sweep_points=1)).check_sweep(family.evaluations(), None)  # local: no cap

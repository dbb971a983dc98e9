"""Pushing an export to the Hub: what would be sent, the refusals, and failing fast offline (no network used)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from layerswap import Checkpoint, Plan, UserError, export_merge
from layerswap.merge.publish import git_blob_id, plan_push, sha256


@pytest.fixture(scope="module")
def export(trio, tmp_path_factory):
    out = tmp_path_factory.mktemp("push") / "merged"
    export_merge(Checkpoint.open(trio["math"]), Checkpoint.open(trio["lang"]), Plan(b=1, u=1), out, device="cpu")
    return out


def test_a_new_repo_gets_every_file_of_the_export(export):
    plan = plan_push(export, "me/merge")
    sent = {rel for rel, _, _ in plan.upload}
    assert {"model.safetensors", "config.json", "README.md", "layerswap.json", "tokenizer.json"} <= sent
    assert plan.bytes == sum((export / rel).stat().st_size for rel in sent) and not plan.unchanged
    card = (export / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers") and "layer-swapping" in card


def test_only_changed_files_are_sent_again(export):
    remote = {rel: (git_blob_id(export / rel), None) for rel, _, _ in plan_push(export, "me/m").upload}
    remote["model.safetensors"] = ("x", sha256(export / "model.safetensors"))  # LFS files compare by sha256
    remote["config.json"] = ("0" * 40, None)  # changed on the Hub side
    plan = plan_push(export, "me/m", remote)
    assert [rel for rel, _, _ in plan.upload] == ["config.json"]
    assert "model.safetensors" in plan.unchanged and "layerswap.json" in plan.unchanged


def test_refusals_say_what_to_do(export, tmp_path):
    with pytest.raises(UserError, match="not a layerswap export .*layerswap merge -o DIR"):
        plan_push(tmp_path, "me/m")
    for bad, msg in (("no-owner", "must be owner/name"), ("me/bad name", "not valid on the Hub"), ("a/b/c", "owner/name")):
        with pytest.raises(UserError, match=msg):
            plan_push(export, bad)
    foreign = {".gitattributes": ("a", None), "model.safetensors": ("b", "c")}
    with pytest.raises(UserError, match="already exists and is not a layerswap export.*--overwrite"):
        plan_push(export, "me/m", foreign, remote_is_export=False)
    assert plan_push(export, "me/m", foreign, remote_is_export=False, overwrite=True).upload
    # a repo the Hub just created holds only .gitattributes: it is ours to fill
    assert plan_push(export, "me/m", {".gitattributes": ("a", None)}, remote_is_export=False).upload


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_offline_fails_within_seconds(export, env):
    code = "import sys; from layerswap.cli import main; sys.exit(main(sys.argv[1:]))"
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, "push", str(export), "me/merge"], capture_output=True, text=True,
                       timeout=120, env={**__import__("os").environ, **env})
    assert r.returncode == 2 and "not reachable" in r.stderr and "Traceback" not in r.stderr
    assert time.perf_counter() - t < 60  # a bound on hanging, not a speed test


def test_merge_push_to_is_checked_before_merging(trio, tmp_path):
    from tests.helpers import run_cli

    models = ["--math", str(trio["math"]), "--lang", str(trio["lang"]), "--b", "1", "--u", "1"]
    r = run_cli("merge", *models, "-o", str(tmp_path / "a"), "--push-to", "not an id")
    assert r.returncode == 2 and "must be owner/name" in r.stderr and not (tmp_path / "a").exists()
    code = "import sys; from layerswap.cli import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "merge", *models, "-o", str(tmp_path / "b"), "--push-to", "me/m"],
                       capture_output=True, text=True, timeout=120, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "layerswap push` later" in r.stderr and not (tmp_path / "b").exists()


# ---- whose token: a fake Hub on loopback sees every request's Authorization header ----------------

class FakeHub:
    """Answers the requests of a first push (no repo yet, every file sent as a regular file) and
    records the method, path and Authorization header of each."""

    def __init__(self):
        import http.server
        import threading

        hub = self
        self.requests: list[tuple[str, str, str | None]] = []
        self.validated: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self):
                import json

                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                hub.requests.append((self.command, self.path, self.headers.get("Authorization")))
                repo = "me/merge"
                if self.command == "GET" and self.path.startswith(f"/api/models/{repo}"):
                    return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                if self.path == "/api/validate-yaml":  # huggingface_hub checks a README's front matter first
                    hub.validated.append(json.loads(body)["content"])
                    return self._json(200, {"errors": [], "warnings": []})
                if self.path == "/api/repos/create":
                    return self._json(200, {"url": f"{hub.url}/{repo}", "name": repo, "id": "1"})
                if "/preupload/" in self.path:
                    files = json.loads(body)["files"]
                    return self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                      for f in files]})
                if "/commit/" in self.path:
                    return self._json(200, {"commitUrl": f"{hub.url}/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40})
                return self._json(404, {"error": f"fake hub: no route for {self.command} {self.path}"})

            def _json(self, status, obj, headers=None):
                import json

                data = json.dumps(obj).encode()
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_HEAD = do_PUT = _answer

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub():
    hub = FakeHub()
    yield hub
    hub.close()


def _push_in_subprocess(export, hub: FakeHub, call: str) -> subprocess.CompletedProcess:
    """`publish.push` in a fresh process whose Hub is `hub` and whose own login is the owner's token."""
    import os

    code = ("import sys; from layerswap.merge.publish import push; from layerswap.core.errors import UserError\n"
            f"try:\n    r = push({str(export)!r}, 'me/merge', {call})\n    print('PUSHED', r.uploaded)\n"
            "except UserError as e:\n    print('REFUSED', e); sys.exit(2)\n")
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_owner_secret", "HF_HUB_DISABLE_XET": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                          env=env)


def test_a_visitor_push_carries_the_visitors_token_only(export, fake_hub):
    r = _push_in_subprocess(export, fake_hub, "token='hf_visitor'")
    assert r.returncode == 0 and "PUSHED" in r.stdout, r.stdout + r.stderr[-3000:]
    paths = [p for _, p, _ in fake_hub.requests]
    assert "/api/repos/create" in paths and any("/commit/" in p for p in paths)
    assert {auth for _, _, auth in fake_hub.requests} == {"Bearer hf_visitor"}
    assert fake_hub.validated == [(export / "README.md").read_text()]  # the export's card is the repo's README


def test_the_cli_path_uses_this_machines_login(export, fake_hub):
    r = _push_in_subprocess(export, fake_hub, "token=None, allow_ambient_token=True")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert {auth for _, _, auth in fake_hub.requests} == {"Bearer hf_owner_secret"}


@pytest.mark.parametrize("call", ["token=None", "token=''", "token='  '"])
def test_no_token_is_refused_before_any_request(export, fake_hub, call):
    r = _push_in_subprocess(export, fake_hub, call)
    assert r.returncode == 2 and "REFUSED Log in with your Hugging Face account first" in r.stdout, r.stdout + r.stderr
    assert fake_hub.requests == []


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_a_visitor_push_offline_is_refused_at_once(export, monkeypatch, env):
    from layerswap.models.hub import hub_reachable
    from layerswap.merge.publish import push

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    hub_reachable.cache_clear()  # the check is cached per process: make this one see the environment above
    try:
        t = time.perf_counter()
        with pytest.raises(UserError, match="not reachable from this machine .*nothing was pushed"):
            push(export, "me/merge", token="hf_visitor")
        assert time.perf_counter() - t < 10
    finally:
        hub_reachable.cache_clear()

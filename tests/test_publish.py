"""Pushing an export to the Hub: what would be sent, the refusals, and failing fast offline (no network used)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from layerswap import Checkpoint, Plan, UserError, export_merge
from layerswap.publish import git_blob_id, plan_push, sha256


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

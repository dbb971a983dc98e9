"""Keeping a merge: pushing an exported folder to the user's own Hugging Face Hub repo.

    result = push("merged/", "me/my-merge", token=visitor_token)                  # the app: a visitor's own token
    result = push("merged/", "me/my-merge", token=None, allow_ambient_token=True)  # the CLI: this machine's login

Only a folder `export_merge` wrote (it holds ``layerswap.json``) is pushed; its model card
(README.md) becomes the repo's. Files already on the Hub with the same content are not sent
again (git blob ids for small files, sha256 for LFS files); large files go up one by one
(``preupload_lfs_files``), so progress is reported in bytes and a cancel is honoured between
files; everything lands in one commit. A repo that exists and is not a layerswap export is
refused unless `overwrite`.

Whose token: only the one passed. ``HF_TOKEN`` or a cached ``hf auth login`` is used only when the
caller says so (``allow_ambient_token=True``, which the CLI does for its own user); without it a
missing token is refused ("Log in with your Hugging Face account first"), so a visitor's push in
the app can never fall back to the login of the server it runs on.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from layerswap.merge.card import read_provenance
from layerswap.core.errors import UserError
from layerswap.merge.outputs import EXPORT_MARK
from layerswap.models.hub import hub_error, hub_reachable
from layerswap.core.runtime import Progress, no_progress

LOGIN_FIRST = ("Log in with your Hugging Face account first: the push goes to your own account, with your own "
               "token (a write token), never the server's.")


@dataclass
class PushPlan:
    """What a push sends: files whose content is not on the Hub yet, and those left as they are."""

    repo_id: str
    upload: list[tuple[str, Path, int]]  # (path in repo, local file, bytes)
    unchanged: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(n for _, _, n in self.upload)


@dataclass
class PushResult:
    repo_id: str
    url: str
    uploaded: list[str]
    unchanged: list[str]
    bytes_sent: int
    commit_url: str | None


def check_repo_id(repo_id: str) -> str:
    """``owner/name`` as the Hub accepts it, or a UserError saying what is wrong."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id = (repo_id or "").strip()
    if repo_id.count("/") != 1:
        raise UserError(f"Repo id {repo_id!r} must be owner/name (your user or organisation, then the new repo's name).")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise UserError(f"Repo id {repo_id!r} is not valid on the Hub: {str(e).splitlines()[0]}") from None
    return repo_id


def export_files(folder: str | os.PathLike) -> list[Path]:
    """The files of a layerswap export (refused unless it holds ``layerswap.json``)."""
    folder = Path(folder)
    read_provenance(folder)
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))


def git_blob_id(path: Path) -> str:
    """The id git (and the Hub) gives a small file: sha1 of ``blob <size>\\0<content>``."""
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def plan_push(folder: str | os.PathLike, repo_id: str, remote: dict[str, tuple[str | None, str | None]] | None = None,
              *, remote_is_export: bool = True, overwrite: bool = False) -> PushPlan:
    """Decide what to send. `remote`: path -> (git blob id, LFS sha256 or None) of the files already in
    the repo (None: no repo yet); `remote_is_export`: whether it holds a layerswap export."""
    folder = Path(folder)
    repo_id = check_repo_id(repo_id)
    files = export_files(folder)
    foreign = [p for p in (remote or {}) if p != ".gitattributes"]  # a new Hub repo holds only .gitattributes
    if foreign and not remote_is_export and not overwrite:
        raise UserError(f"{repo_id} already exists and is not a layerswap export (no {EXPORT_MARK}); nothing was "
                        "pushed. Choose another name, or pass --overwrite to push into it anyway.")
    plan = PushPlan(repo_id, [])
    for p in files:
        rel = p.relative_to(folder).as_posix()
        blob, lfs = (remote or {}).get(rel, (None, None))
        same = (lfs is not None and lfs == sha256(p)) or (lfs is None and blob is not None and blob == git_blob_id(p))
        if same:
            plan.unchanged.append(rel)
        else:
            plan.upload.append((rel, p, p.stat().st_size))
    return plan


def push(folder: str | os.PathLike, repo_id: str, *, token: str | None, allow_ambient_token: bool = False,
         private: bool = False, revision: str | None = None, overwrite: bool = False,
         progress: Progress = no_progress, cancel: threading.Event | None = None) -> PushResult:
    """Upload an export to `repo_id` (created if needed), sending only what changed, in one commit.

    `token`: the pusher's own Hub token, the only one used. Empty or None is refused with
    `LOGIN_FIRST`, unless `allow_ambient_token` (the CLI): then this machine's login
    (``HF_TOKEN``, or ``hf auth login``) is used. `progress(fraction, text)` follows the bytes sent;
    setting `cancel` stops between files, before the commit (no file of the repo changes).
    """
    token = (token or "").strip() or None
    if token is None and not allow_ambient_token:
        raise UserError(LOGIN_FIRST)
    repo_id = check_repo_id(repo_id)
    export_files(folder)  # refuse early, before any network
    if not hub_reachable():
        raise UserError("The Hugging Face Hub is not reachable from this machine (offline, or HF_HUB_OFFLINE=1): "
                        "nothing was pushed. Push later from a machine with network access.")
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=token)
    try:
        remote, is_export = None, True
        if api.repo_exists(repo_id):  # a new branch starts from the default one: compare with that
            rev = revision if revision and api.revision_exists(repo_id, revision) else None
            remote = {f.path: (f.blob_id, f.lfs.sha256 if getattr(f, "lfs", None) else None)
                      for f in api.list_repo_tree(repo_id, recursive=True, expand=True, revision=rev)
                      if hasattr(f, "blob_id")}
            is_export = EXPORT_MARK in remote
        plan = plan_push(folder, repo_id, remote, remote_is_export=is_export, overwrite=overwrite)
        url = str(api.create_repo(repo_id, private=private, exist_ok=True))
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        total, sent, ops = max(plan.bytes, 1), 0, []
        progress(0.0, f"{len(plan.upload)} files to send ({plan.bytes / 1e6:.1f} MB), {len(plan.unchanged)} unchanged")
        for rel, path, n in plan.upload:
            if cancel is not None and cancel.is_set():
                raise UserError(f"Push to {repo_id} cancelled after {sent / 1e6:.1f} MB; no commit was made "
                                "(files already sent are reused by the next push).")
            op = CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(path))
            api.preupload_lfs_files(repo_id, [op], revision=revision)
            ops.append(op)
            sent += n
            progress(sent / total, f"sent {rel} ({sent / 1e6:.1f} of {plan.bytes / 1e6:.1f} MB)")
        commit = None
        if ops:
            info = api.create_commit(repo_id, ops, commit_message=_commit_message(folder), revision=revision)
            commit = info.commit_url
    except HfHubHTTPError as e:
        raise UserError(f"The Hub refused the push to {repo_id} ({_hub_reason(e)}); check that the token may write to "
                        "that owner (a write token, or your own login).") from None
    except ValueError as e:  # huggingface_hub's check of README.md's front matter, before the commit
        if "metadata" not in str(e):
            raise
        raise UserError(f"The Hub refused the model card of {folder} ({str(e).strip()}); nothing was committed. "
                        "Fix README.md's front matter and push again.") from None
    progress(1.0, "pushed")
    return PushResult(repo_id, url, [r for r, _, _ in plan.upload], plan.unchanged, sent, commit)


def _commit_message(folder: str | os.PathLike) -> str:
    prov = read_provenance(folder)
    method = (prov.get("method") or {}).get("name", "merge")
    return f"layerswap {prov.get('layerswap_version', '')} {method} merge".strip()


def _hub_reason(e: Exception) -> str:
    return hub_error(e)

"""Hosted mode: the rules for serving strangers (a Hugging Face Space, a shared server).

    policy = Policy.from_env()            # LAYERSWAP_HOSTED=1, or on a Space unless LAYERSWAP_HOSTED=0
    ref = policy.check_ref("owner/name")  # Hub ids or shipped `assets:` references only
    path = fetch("owner/name", policy.limits, cancel=ev)  # size-checked, no token, cancellable

In hosted mode visitors name models by Hub id (optionally only those in an allowlist file) or by a
shipped preset; no server path is accepted or shown (`scrub`). Hub downloads never send a token:
a Space owner's token must not fetch gated or private repos for a stranger. Caps bound free text,
evaluations, sweeps, downloads and the export zip; the page states them.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .errors import UserError, whole_number
from .hub import looks_like_hub_id
from .presets import ASSETS_PREFIX
from .runtime import Progress, no_progress

HOSTED_ENV = "LAYERSWAP_HOSTED"
_GB = 10**9


def forbid_implicit_token() -> None:
    """Hub calls send a token only when one is passed explicitly (a visitor's own, for a push):
    the server's HF_TOKEN or cached login is never used on a visitor's behalf."""
    import huggingface_hub.constants as c

    os.environ["HF_HUB_DISABLE_IMPLICIT_TOKEN"] = "1"  # child processes (vLLM workers)
    c.HF_HUB_DISABLE_IMPLICIT_TOKEN = True


def gpu_mode(env: Mapping[str, str] = os.environ) -> str:
    """``zerogpu`` (a ZeroGPU Space: no vLLM, GPU only inside decorated calls), ``dedicated`` (a GPU
    held by this process: vLLM engines, live refresh) or ``cpu``."""
    if env.get("SPACES_ZERO_GPU", "").lower() in ("1", "true"):
        return "zerogpu"
    try:
        import torch

        return "dedicated" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def on_space(env: Mapping[str, str] = os.environ) -> bool:
    """Running as a Hugging Face Space (where the page's Hugging Face login is real OAuth)."""
    return bool(env.get("SPACE_ID"))


def hosted_from_env(env: Mapping[str, str] = os.environ) -> bool:
    """`LAYERSWAP_HOSTED` (1/0) when set, else on when the Spaces environment is detected."""
    v = env.get(HOSTED_ENV, "").strip().lower()
    if v:
        return v in ("1", "true", "yes", "on")
    return on_space(env) or env.get("SYSTEM") == "spaces"


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(float(env.get(name, default)))
    except ValueError:
        raise UserError(f"{name}={env[name]!r} is not a number.") from None


@dataclass(frozen=True)
class Limits:
    """Caps for visitors (each from `LAYERSWAP_MAX_*`); stated on the page in hosted mode."""

    text_chars: int = 2000
    eval_questions: int = 400  # per language and model
    sweep_points: int = 24
    search_plans: int = 40  # plans one search may evaluate
    download_bytes: int = 40 * _GB  # all files of one Hub model
    zip_bytes: int = 2 * _GB  # the export offered as a download
    new_tokens: int = 512  # tokens generated per answer
    lens_questions: int = 32  # parallel questions in one run of the lens
    ref_chars: int = 200  # a model reference (owner/name@revision)
    visitor_disk_bytes: int = 20 * _GB  # one visitor's folder (export, its zip, results)
    disk_bytes: int = 60 * _GB  # all visitors' folders and the files served from them
    hub_cache_bytes: int = 200 * _GB  # the Hugging Face cache, pruned least recently used first

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Limits":
        d = cls()
        return cls(text_chars=_int_env(env, "LAYERSWAP_MAX_TEXT_CHARS", d.text_chars),
                   eval_questions=_int_env(env, "LAYERSWAP_MAX_EVAL_QUESTIONS", d.eval_questions),
                   sweep_points=_int_env(env, "LAYERSWAP_MAX_SWEEP_POINTS", d.sweep_points),
                   search_plans=_int_env(env, "LAYERSWAP_MAX_SEARCH_PLANS", d.search_plans),
                   download_bytes=_int_env(env, "LAYERSWAP_MAX_DOWNLOAD_BYTES", d.download_bytes),
                   zip_bytes=_int_env(env, "LAYERSWAP_MAX_ZIP_BYTES", d.zip_bytes),
                   new_tokens=_int_env(env, "LAYERSWAP_MAX_NEW_TOKENS", d.new_tokens),
                   lens_questions=_int_env(env, "LAYERSWAP_MAX_LENS_QUESTIONS", d.lens_questions),
                   visitor_disk_bytes=_int_env(env, "LAYERSWAP_MAX_VISITOR_DISK_BYTES", d.visitor_disk_bytes),
                   disk_bytes=_int_env(env, "LAYERSWAP_MAX_DISK_BYTES", d.disk_bytes),
                   hub_cache_bytes=_int_env(env, "LAYERSWAP_MAX_HUB_CACHE_BYTES", d.hub_cache_bytes))

    def markdown(self) -> str:
        return (f"questions and free text up to {self.text_chars:,} characters; answers up to {self.new_tokens:,} "
                f"tokens; the lens up to {self.lens_questions} questions at once; evaluations up to "
                f"{self.eval_questions:,} questions per language; sweeps up to {self.sweep_points} recipes; plan "
                f"searches up to {self.search_plans} plans; Hub "
                f"models up to {self.download_bytes / _GB:.0f} GB; export downloads up to "
                f"{self.zip_bytes / _GB:.1f} GB; your files up to {self.visitor_disk_bytes / _GB:.0f} GB, kept an hour "
                "after their export")


@dataclass(frozen=True)
class Policy:
    """What visitors may do. Off (`hosted=False`): a local research tool, any folder or Hub id."""

    hosted: bool = False
    limits: Limits = field(default_factory=Limits)
    allowlist: frozenset[str] | None = None  # Hub ids (owner/name); None: any public id

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Policy":
        hosted = hosted_from_env(env)
        allow = env.get("LAYERSWAP_ALLOWLIST")
        return cls(hosted, Limits.from_env(env) if hosted else Limits(), read_allowlist(allow) if allow else None)

    def check_ref(self, ref: str, what: str = "model") -> str:
        """`ref` stripped; in hosted mode only Hub ids (allowlisted when a list is set) or `assets:` presets."""
        ref = (ref or "").strip()
        if not self.hosted or not ref:
            return ref
        if len(ref) > self.limits.ref_chars:
            raise UserError(f"The {what} reference has {len(ref):,} characters; a Hub id such as 'owner/name' has "
                            f"at most {self.limits.ref_chars}.")
        if ref.startswith(ASSETS_PREFIX):
            return ref
        if not looks_like_hub_id(ref) or Path(ref).expanduser().exists():  # 'owner/name' can be a server folder too
            raise UserError(f"The {what} must be a Hugging Face Hub id such as 'owner/name' (or a preset): this "
                            "server does not open folders for visitors.")
        if self.allowlist is not None and ref.partition("@")[0] not in self.allowlist:
            raise UserError(f"{ref} is not on this server's list of allowed models; pick a preset, or run "
                            "layerswap on your own machine for other models.")
        return ref

    def check_text(self, text: str, what: str = "text") -> str:
        if self.hosted and len(text or "") > self.limits.text_chars:
            raise UserError(f"The {what} has {len(text):,} characters; this server takes up to "
                            f"{self.limits.text_chars:,}.")
        return text

    def new_tokens(self, value: object) -> int:
        """Tokens per answer, from a visitor's field: 1 to 8,192 (hosted: up to the cap)."""
        return whole_number(value, "Max new tokens", 1, self.limits.new_tokens if self.hosted else 8192)

    def lens_batch(self, value: object) -> int:
        """Parallel questions in one run of the lens, from a visitor's field: 1 to 128 (hosted: up to the cap)."""
        return whole_number(value, "The lens batch", 1, self.limits.lens_questions if self.hosted else 128)

    def check_eval(self, limit: int | None, largest_set: int) -> None:
        n = limit or largest_set
        if self.hosted and n > self.limits.eval_questions:
            raise UserError(f"This server evaluates up to {self.limits.eval_questions:,} questions per language "
                            f"(asked: {n:,}); set 'Questions per language' to {self.limits.eval_questions} or less.")

    def check_sweep(self, points: int, eval_limit: int | None) -> None:
        """A sweep's size: at most `sweep_points` recipes, each evaluated within the question cap (a sweep
        without a question limit means whole sets: refused in hosted mode)."""
        if not self.hosted:
            return
        if points > self.limits.sweep_points:
            raise UserError(f"This sweep has {points} recipes; this server runs up to {self.limits.sweep_points}.")
        self.check_eval(eval_limit, largest_set=10**9)

    def check_search(self, budget: int, dev: int, test: int) -> None:
        """A search's size: at most `search_plans` plans, dev and held-out questions each within the question cap."""
        if not self.hosted:
            return
        if budget > self.limits.search_plans:
            raise UserError(f"This server searches up to {self.limits.search_plans} plans (asked: {budget}).")
        self.check_eval(max(dev, test), largest_set=0)

    def scrub(self, text: str) -> str:
        """In hosted mode, absolute server paths become their last component."""
        return scrub_paths(text) if self.hosted and isinstance(text, str) else text


_ABS_PATH = re.compile(r"(?<![\w:/.~-])/(?:[^\s/`'\"()\[\]<>|*]+/)+([^\s/`'\"()\[\]<>|*,;]*)")


def scrub_paths(text: str) -> str:
    """Absolute paths of two or more components (not URLs, not "12 / 3") replaced by their last component."""
    return _ABS_PATH.sub(lambda m: m.group(1) or "…", text)


def read_allowlist(path: str | os.PathLike) -> frozenset[str]:
    """One Hub id per line; blank lines and `#` comments ignored."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UserError(f"Cannot read the allowlist LAYERSWAP_ALLOWLIST ({e.strerror}).") from None
    ids = {ln.split("#")[0].strip() for ln in lines}
    return frozenset(i for i in ids if i)


@dataclass(frozen=True)
class DownloadPlan:
    repo: str
    revision: str  # the commit the files come from
    files: tuple[tuple[str, int], ...]  # (name, bytes)

    @property
    def total(self) -> int:
        return sum(n for _, n in self.files)


def plan_download(ref: str, limits: Limits) -> DownloadPlan:
    """The files a Hub model needs and their sizes (from the Hub's metadata, no token), checked
    against the download cap, free disk in the Hugging Face cache and available memory. Gated and
    private repos are refused here, before any download or cache lookup."""
    from huggingface_hub import HfApi
    from huggingface_hub.constants import HF_HUB_CACHE

    from .checkpoints import HUB_PATTERNS, plain_name
    from .engines.serving import available_memory
    from .hub import hub_error, hub_reachable

    repo, _, revision = ref.partition("@")
    if not hub_reachable():
        raise UserError(f"{ref}: the Hugging Face Hub is not reachable from this server; pick a preset.")
    try:
        info = HfApi().model_info(repo, revision=revision or None, files_metadata=True, token=False)
    except Exception as e:  # missing, private, gated (without a token they all look alike), network
        raise UserError(f"{ref}: cannot read its file list from the Hub ({hub_error(e)}). Only public, "
                        "non-gated models can be loaded here.") from None
    if info.private or info.gated:
        raise UserError(f"{ref} is {'private' if info.private else 'gated (its owner grants access per user)'}: this "
                        "server loads only public, non-gated models, and never with its own token or a cached copy. "
                        "Run layerswap on your own machine, logged in with your own account, to use it.")
    files = tuple((s.rfilename, int(s.size or 0)) for s in info.siblings or []
                  if any(fnmatch.fnmatch(s.rfilename, p) for p in HUB_PATTERNS))
    if not all(plain_name(f) for f, _ in files):
        raise UserError(f"{ref}: its file list names a file outside the repo's own folder; nothing was downloaded.")
    plan = DownloadPlan(repo, info.sha or revision or "main", files)
    weights = sum(n for f, n in files if f.endswith(".safetensors"))
    if not weights:
        raise UserError(f"{ref} has no safetensors weights on the Hub; only safetensors models can be loaded.")
    cache = Path(HF_HUB_CACHE)
    cache.mkdir(parents=True, exist_ok=True)
    free_disk = shutil.disk_usage(cache).free
    checks = [(limits.download_bytes, "this server's download cap"), (free_disk, "the free disk"),
              (available_memory("cpu"), "the available memory")]
    for cap, what in checks:
        if plan.total > cap:
            raise UserError(f"{ref} is {plan.total / _GB:.2f} GB, more than {what} ({cap / _GB:.2f} GB); nothing was "
                            "downloaded. Pick a smaller model.")
    return plan


def fetch(ref: str, limits: Limits, *, progress: Progress = no_progress,
          cancel: threading.Event | None = None) -> Path:
    """Download a Hub model after `plan_download`'s checks, file by file, without a token; `cancel`
    stops between files. Returns the local snapshot folder."""
    from huggingface_hub import hf_hub_download

    from .hub import hub_error

    plan = plan_download(ref, limits)
    done, folder = 0, None
    for name, size in plan.files:
        if cancel is not None and cancel.is_set():
            raise UserError(f"Download of {ref} stopped; {done / _GB:.2f} of {plan.total / _GB:.2f} GB fetched.")
        progress(done / max(plan.total, 1), f"downloading {name} ({size / 1e6:.0f} MB)")
        try:
            path = Path(hf_hub_download(plan.repo, name, revision=plan.revision, token=False))
        except Exception as e:  # network, a file gone since the listing: said without the Hub's address
            raise UserError(f"Download of {ref} failed at {name} ({hub_error(e)}); try again later.") from None
        folder = path.parents[len(Path(name).parts) - 1]
        done += size
    progress(1.0, f"downloaded {ref}")
    assert folder is not None  # plan_download refuses a model without files
    return folder


def fetch_models(policy: Policy, refs: tuple[str, ...], base: str = "", *, progress: Progress = no_progress,
                 cancel: threading.Event | None = None) -> None:
    """Hosted mode, before anything opens `refs`: each Hub model through `fetch`'s checks (cap, disk, memory, no
    token). An adapter used without `base` names its own base: that name is checked like a visitor's and
    fetched the same way, so no path inside a downloaded file reaches the server's folders."""
    from .jsonfile import read_json

    hub = [r for r in refs if r and not r.startswith(ASSETS_PREFIX)]
    for i, ref in enumerate(hub):
        part = lambda f, d, i=i: progress((i + f) / len(hub), d)  # noqa: E731
        cfg = fetch(ref, policy.limits, progress=part, cancel=cancel) / "adapter_config.json"
        own = read_json(cfg) if cfg.exists() and not base else None
        own = own.get("base_model_name_or_path") if isinstance(own, dict) else None
        if own:
            fetch(policy.check_ref(own, f"base model named by the adapter {ref}"), policy.limits, progress=part,
                  cancel=cancel)


def prune_hub_cache(limit: int, keep: set[str], cache: str | os.PathLike | None = None) -> list[str]:
    """Delete whole Hub models from the Hugging Face cache, least recently used first, until it holds at most
    `limit` bytes; models named in `keep` (``owner/name``: loaded or being loaded) are never deleted. Returns
    the models deleted."""
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir(cache)
    except Exception:  # no cache yet, or one huggingface_hub cannot read: nothing to prune
        return []
    size, gone = info.size_on_disk, []
    for repo in sorted(info.repos, key=lambda r: r.last_accessed):
        if size <= limit:
            break
        if repo.repo_type != "model" or repo.repo_id in keep:
            continue
        shutil.rmtree(repo.repo_path, ignore_errors=True)
        size -= repo.size_on_disk
        gone.append(repo.repo_id)
    return gone

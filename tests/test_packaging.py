"""`pip install layerswap` ships the whole library, the app entry point and the demo organism."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.helpers import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None


@pytest.mark.skipif(tomllib is None, reason="needs Python 3.11's tomllib")
def test_every_subpackage_is_listed():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {"layerswap." + ".".join(p.parent.relative_to(REPO / "layerswap").parts)
               for p in (REPO / "layerswap").rglob("__init__.py")}
    on_disk = {p.rstrip(".") for p in on_disk}
    assert on_disk | {"layerswap.assets"} == set(cfg["packages"])


def test_wheel_holds_the_demo_and_the_app(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
                    str(REPO)], check=True, capture_output=True, timeout=600)
    (whl,) = tmp_path.glob("layerswap-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for r in ("base", "math", "lang"):
        assert f"layerswap/assets/demo/{r}/config.json" in names
        assert f"layerswap/assets/demo/{r}/model.safetensors" in names
    assert "layerswap/assets/demo/mgsm/mgsm_xx.tsv" in names
    assert "layerswap/ui/launch.py" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "layerswap = layerswap.cli:main" in zipfile.ZipFile(whl).read(entry).decode()
    # installed (not editable), the package finds its own copy of the demo
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(whl)],
                   check=True, capture_output=True, timeout=600)
    code = "from layerswap.shipped.demo import demo_paths; print(demo_paths()[0]['math'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": ""}, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(target / "layerswap" / "assets" / "demo" / "math")


@pytest.mark.skipif(tomllib is None, reason="needs Python 3.11's tomllib")
def test_space_requirements_and_front_matter_match_the_project():
    """requirements.txt (what a Space installs) = pyproject's dependencies + the GPU vLLM extra + the package;
    the README's Space front matter names the gradio in use, the app file and a Python the project accepts."""
    import gradio
    import yaml

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [ln.strip() for ln in (REPO / "requirements.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    assert reqs == project["dependencies"] + project["optional-dependencies"]["vllm"] + ["."]
    text = (REPO / "README.md").read_text()
    assert text.startswith("---\n")
    meta = yaml.safe_load(text.split("---\n")[1])
    assert meta["sdk"] == "gradio" and meta["sdk_version"] == gradio.__version__
    assert (REPO / meta["app_file"]).is_file() and meta["app_file"] == "app.py"
    major, minor = (int(x) for x in str(meta["python_version"]).split("."))
    assert project["requires-python"] == ">=3.10" and (major, minor) >= (3, 11)  # vLLM needs 3.11
    assert meta["suggested_hardware"] and meta["startup_duration_timeout"]

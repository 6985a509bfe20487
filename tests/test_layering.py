"""The layering of docs/architecture.md, as pyproject.toml's import-linter contracts state it: no
module imports from a layer above its own, no package's modules import each other in a circle,
and every module of the package sits in a layer (a new one must be placed before it can pass)."""

import subprocess
import sys
from pathlib import Path

import pytest
from importlinter import api

REPO = Path(__file__).parent.parent
PYPROJECT = REPO / "pyproject.toml"


def test_the_imports_keep_the_contracts():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--config", str(PYPROJECT), "--no-cache"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 2 kept, 0 broken." in done.stdout


def layer_modules() -> list[str]:
    contract = next(c for c in api.read_configuration(str(PYPROJECT))["contracts_options"]
                    if c["type"] == "layers")
    return [name.strip().strip("()") for layer in contract["layers"]
            for name in layer.replace("|", ":").split(":")]


def test_every_module_is_in_a_layer():
    package = REPO / "mac_moesd"
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
               for p in package.rglob("*.py")} - {"mac_moesd"}
    layered = layer_modules()
    # a package split over two layers (analysis) is only their container
    outside = sorted(m for m in modules if not any(m == top or m.startswith(top + ".") or top.startswith(m + ".")
                                                   for top in layered))
    assert outside == [], "add them to a layer in pyproject.toml's [tool.importlinter]"


def test_every_package_folder_is_installed():
    import tomllib

    listed = set(tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "mac_moesd").rglob("__init__.py")}
    assert folders - listed == set()


@pytest.mark.slow  # builds the wheel as pip installs it (seconds, with a C compile)
def test_the_wheel_holds_every_module_and_the_kernels_and_each_imports_installed(tmp_path):
    import zipfile

    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                           "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = tmp_path.glob("mac_moesd-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "mac_moesd").rglob("*.py")}
    kernels = {f"mac_moesd/metal/{p.name}" for p in (REPO / "kernels").glob("*.metal")}
    data = {p.relative_to(REPO).as_posix() for p in (REPO / "mac_moesd" / "data").rglob("*.txt")}
    assert kernels and data and modules - names == set() and kernels - names == set() and data - names == set()
    # Installed from the wheel alone, every module imports (the package's own __main__ aside: it
    # runs the command line).
    installed = tmp_path / "installed"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(installed),
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    dotted = sorted(n[: -len(".py")].replace("/", ".").removesuffix(".__init__") for n in names
                    if n.startswith("mac_moesd/") and n.endswith(".py") and not n.endswith("__main__.py"))
    code = ("import importlib, sys; sys.path.insert(0, sys.argv[1]); import mac_moesd; "
            "assert mac_moesd.__file__.startswith(sys.argv[1]), mac_moesd.__file__; "
            "[importlib.import_module(name) for name in sys.argv[2:]]")
    done = subprocess.run([sys.executable, "-c", code, str(installed), *dotted], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(dotted) > 100 and "mac_moesd.measure.sd.speedup" in dotted

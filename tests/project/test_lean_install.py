"""The lean install: the library (the math and the models) needs only the core dependencies of pyproject.toml.

The trainer, the service, rewards and evaluation are the `train` extra; `pip install drgrpo_jax` for the loss alone
must neither import nor install them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest

from support.paths import REPO

# Packages of the `train` extra (import names) that the math and the models must never import.
TRAINER_ONLY = ("transformers", "orbax", "fastapi", "uvicorn", "pydantic", "httpx", "omegaconf", "reasoning_gym",
                "math_verify", "pyarrow", "tensorboardX", "tqdm", "matplotlib", "torch", "safetensors", "tokenizers",
                "jinja2")

IMPORT_THE_LIBRARY = """
import importlib, json, pkgutil, sys
import drgrpo_jax, drgrpo_jax.advantages, drgrpo_jax.algorithms, drgrpo_jax.losses, drgrpo_jax.integrations
import drgrpo_jax.models
for info in pkgutil.iter_modules(drgrpo_jax.models.__path__):
    importlib.import_module("drgrpo_jax.models." + info.name)
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def imported_by_the_library(python: str, cwd: str) -> set[str]:
    result = subprocess.run([python, "-c", IMPORT_THE_LIBRARY], capture_output=True, text=True, cwd=cwd, timeout=600)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.subprocess
def test_the_math_and_models_import_nothing_of_the_trainer():
    imported = imported_by_the_library(sys.executable, REPO)
    assert not imported & set(TRAINER_ONLY), f"the library imports {sorted(imported & set(TRAINER_ONLY))}"


def test_the_core_dependencies_are_the_librarys_and_dev_installs_the_trainer():
    with open(f"{REPO}/pyproject.toml", "rb") as file:
        project = tomllib.load(file)["project"]
    names = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in project["dependencies"]}
    assert names == {"jax", "flax", "optax", "chex", "numpy", "gguf", "ml-dtypes"}
    assert "drgrpo_jax[train]" in project["optional-dependencies"]["dev"]
    train = {d.split(">")[0].strip() for d in project["optional-dependencies"]["train"]}
    assert {"transformers", "fastapi", "reasoning-gym", "matplotlib", "orbax-checkpoint"} <= train


def foreign_loop_source() -> str:
    """The code of notebooks/loss_fn_in_your_trainer.ipynb without its plot (matplotlib is the train extra's)."""
    with open(f"{REPO}/notebooks/loss_fn_in_your_trainer.ipynb") as file:
        notebook = json.load(file)
    cells = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = "".join(cell["source"]).splitlines()
        lines = [line for line in lines if line != "import matplotlib.pyplot as plt"]
        figure = next((i for i, line in enumerate(lines) if line.startswith("figure,")), len(lines))
        cells.append("\n".join(lines[:figure]))
    source = "\n\n".join(cells)
    assert "plt" not in source, "the notebook plots somewhere else now: cut that out here too"
    return source


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_core_only_install_runs_the_loss_notebooks_foreign_loop(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", str(REPO)], check=True, timeout=1800)
    installed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                               check=True).stdout
    names = {package["name"].lower() for package in json.loads(installed)}
    assert not names & {"transformers", "fastapi", "reasoning-gym", "math-verify", "matplotlib", "torch"}, names
    assert not imported_by_the_library(python, str(tmp_path)) & set(TRAINER_ONLY)
    script = tmp_path / "foreign_loop.py"
    script.write_text(foreign_loop_source())
    result = subprocess.run([python, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=1800)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "4 micro-batches" in result.stdout and "reward: first 5 steps" in result.stdout

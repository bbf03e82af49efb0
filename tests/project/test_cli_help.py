"""Every command line documents every flag: `python -m MODULE --help` of each CLI is read as a user reads it, and
each option or positional it lists must carry a description; internal flags are hidden. The console scripts in
pyproject.toml name the same `main` functions as `python -m`.

The generation service's CLI (drgrpo_jax/serve/cli.py) is checked the same way in its own test: it passes only
once serve's help names every flag and hides its internal ones (--parent-pid, --port-file)."""

import importlib
import os
import re
import subprocess
import sys
import tomllib

import pytest

from support.paths import REPO

# The CLIs and the subcommands whose --help is checked (argv after `python -m`).
COMMANDS = [
    ["drgrpo_jax.train"],
    ["drgrpo_jax.evaluate"],
    ["drgrpo_jax.plan"],
    ["drgrpo_jax.config"],
    ["drgrpo_jax.data"],
    ["drgrpo_jax.data", "prepare"],
    ["drgrpo_jax.launch", "slurm"],
    ["drgrpo_jax.launch", "gke"],
    ["drgrpo_jax.launch", "skypilot"],
]
_ITEM = re.compile(r"^  (\S.*?)(?:\s{2,}(\S.*))?$")  # an option or positional: its invocation, then its help


def help_text(argv: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", *argv, "--help"], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout


def undocumented(text: str) -> list[str]:
    """The items of argparse's argument sections ("options:", "positional arguments:", ...) that carry no help:
    an item's help follows its invocation on the same line or starts on the next, indented further."""
    missing, in_section, lines = [], False, text.splitlines()
    for number, line in enumerate(lines):
        if not line.strip():
            in_section = False
            continue
        if not line.startswith(" ") and line.endswith(":"):
            in_section = not line.lower().startswith(("usage", "config sections", "datasets"))
            continue
        match = _ITEM.match(line) if in_section else None
        if match is None:
            continue
        following = lines[number + 1] if number + 1 < len(lines) else ""
        continued = following.startswith("   ") and not following.startswith("  -") and bool(following.strip())
        if not match[2] and not continued:
            missing.append(match[1].split()[0].rstrip(","))
    return missing


def test_the_reader_finds_an_undocumented_flag():
    import argparse

    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--documented", help="says what it does")
    parser.add_argument("--a-very-long-flag-name-that-wraps", metavar="VALUE", help="help on the next line")
    parser.add_argument("--bare")
    parser.add_argument("name", choices=["one", "two"])
    assert sorted(undocumented(parser.format_help())) == ["--bare", "{one,two}"]


@pytest.mark.subprocess
@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_every_flag_has_help(argv):
    text = help_text(argv)
    assert "--help" in text
    assert undocumented(text) == [], f"python -m {' '.join(argv)} --help"


@pytest.mark.subprocess
def test_serve_documents_every_flag_and_hides_its_internal_ones():
    text = help_text(["drgrpo_jax.serve"])
    assert undocumented(text) == [], "python -m drgrpo_jax.serve --help"
    for internal in ("--parent-pid", "--port-file"):  # set by the trainer's child-service launcher, not by users
        assert internal not in text


def test_console_scripts_are_the_module_mains():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as file:
        scripts = tomllib.load(file)["project"]["scripts"]
    assert set(scripts) == {"drgrpo-train", "drgrpo-serve", "drgrpo-evaluate", "drgrpo-plan", "drgrpo-data",
                            "drgrpo-launch"}
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), name
        with open(os.path.join(REPO, *module.split(".")[:2], "__main__.py")) as file:  # drgrpo_jax/X/__main__.py
            assert f"from {module} import {function}" in file.read(), f"{name} and python -m run different mains"

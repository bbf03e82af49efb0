"""The documents a user reads: every relative link points at a file that exists, and README command 2 runs the
checks CI runs."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "configs" / "README.md",
                    *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^```.*?^```", re.S | re.M)  # code blocks: their brackets are code, not links
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(text: str) -> list[str]:
    """The targets of the Markdown links and images in `text` that name a file of the repository (no URL scheme,
    no bare anchor), without their anchors."""
    targets = LINK.findall(FENCE.sub("", text))
    return [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_the_link_finder_reads_links_and_images_and_skips_urls_anchors_and_code():
    text = ("See [a](docs/a.md#part), ![b](b.png \"title\"), [c](https://x.org/c.md), [d](#local), "
            "[e](mailto:x@y.z).\n```python\nx = [f](g.md)\n```\n[h](../h.md)")
    assert relative_links(text) == ["docs/a.md", "b.png", "../h.md"]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_relative_link_points_at_a_file_that_exists(document):
    links = relative_links(document.read_text())
    missing = [link for link in links if not (document.parent / link).exists()]
    assert not missing, f"{document.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_the_documents_are_there():
    assert {"README.md", "CONTRIBUTING.md", "configs/README.md", "docs/index.md", "docs/benchmarks.md",
            "docs/shape_letters.md"} <= {path.relative_to(ROOT).as_posix() for path in DOCUMENTS}


def _checks(commands: str) -> list[str]:
    """The lint, type, docs and test commands of a shell text, in order (installs left out)."""
    steps = [step.strip() for line in commands.splitlines() for step in line.split("&&")]
    return [step for step in steps if step.split(" ", 1)[0] in ("ruff", "mypy", "mkdocs")
            or step.startswith("python -m pytest")]


def test_readme_command_2_runs_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    command_2 = next(line for line in readme.splitlines() if "pip install -e '.[dev]'" in line)
    ci = _checks((ROOT / ".ci" / "run").read_text())
    assert _checks(command_2) == ci[:4] == ["ruff check .", "mypy", "mkdocs build --strict", "python -m pytest -n 2"]
    # After it, only the real engines' own steps (slow tests the plain suite leaves out), e.g. SLURM's.
    assert all(step.startswith("python -m pytest -m slow tests/") for step in ci[4:])


def test_the_reference_pages_algorithm_table_is_the_table_the_trainer_runs():
    """docs/hooks/algorithm_table.py writes one row per ALGORITHMS entry at build time, where the page asks for it."""
    import importlib.util

    from drgrpo_jax.algorithms import ALGORITHMS

    spec = importlib.util.spec_from_file_location("algorithm_table", ROOT / "docs" / "hooks" / "algorithm_table.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    rows = hook.algorithm_table().splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == [f"| `{name}`" for name in ALGORITHMS]
    gdpo = rows[list(ALGORITHMS).index("gdpo")]
    assert gdpo == ("| `gdpo` | `gdpo_combined`, then whitened per optimizer window | `token_mean` | `ppo_clip` | "
                    "`kl_in_reward`, `scale_rewards`, `whiten_advantages` |")
    page = (ROOT / "docs" / "reference.md").read_text()
    assert hook.MARKER in page
    assert hook.on_page_markdown(page).count("| `dr_grpo` | `dr_grpo` | `fixed_budget` |") == 1


def test_the_home_page_table_lists_every_page_of_the_navigation():
    navigation = set(re.findall(r":\s*([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)) - {"index.md"}
    listed = set(relative_links((ROOT / "docs" / "index.md").read_text()))
    assert navigation - listed == set(), "pages of the navigation missing from docs/index.md's table"

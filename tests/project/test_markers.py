"""The test tiers of tests/conftest.py, as pytest collects them: plain runs keep heavy tests, an -m expression
leaves heavy and slow tests out unless it names them."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.subprocess  # pytest --collect-only in a child process

LIGHT = "tests/models/test_models.py::test_unpadded_parity[llama]"
HEAVY = "tests/models/test_models.py::test_causal_by_gradient[llama]"


def _collected(*marker_args: str) -> set[str]:
    listing = subprocess.run([sys.executable, "-m", "pytest", "tests/models/test_models.py", "--collect-only", "-q",
                              "-p", "no:cacheprovider", *marker_args], capture_output=True, text=True, check=True)
    return {line for line in listing.stdout.splitlines() if "::" in line}


@pytest.mark.parametrize(("marker_args", "light", "heavy"), [
    ((), True, True),  # the README's command and CI
    (("-m", "not subprocess"), True, False),  # the inner loop
    (("-m", "heavy or not subprocess"), True, True),
    (("-m", "heavy"), False, True),
])
def test_an_m_expression_leaves_heavy_tests_out_unless_it_names_them(marker_args, light, heavy):
    collected = _collected(*marker_args)
    assert (LIGHT in collected, HEAVY in collected) == (light, heavy), collected

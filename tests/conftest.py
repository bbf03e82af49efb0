"""Test setup: 8 fake CPU devices, no hub access, float32 matmuls at full precision, quick machine code."""

import os

# The tests' programs are tiny, so compiling them costs more than running them: LLVM at -O0 cut a cold
# test_train_step.py from 252 s to 159 s on 2 cores. XLA's HLO passes (fusion, layout) still run; only the
# machine code differs, which can move last-bit rounding (e.g. where a multiply-add is fused), inside every
# test's tolerance.
# Any optimisation level given in XLA_FLAGS wins; the service and trainer the tests start inherit the flags.
_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _FLAGS:
    _FLAGS += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_FLAGS + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no network here; MLflow would try to report usage

import jax  # noqa: E402  (must come after XLA_FLAGS)

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_numpy_rank_promotion", "raise")
# Compiles dominate the in-process tests; XLA's persistent cache (keyed on the program, the options and the
# jax version, so never stale) makes every run after the first ~3x faster. DRGRPO_TEST_JAX_CACHE="" turns it off.
_CACHE = os.environ.get("DRGRPO_TEST_JAX_CACHE", os.path.join(os.path.dirname(__file__), "..", ".cache", "jax-tests"))
if _CACHE:
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(_CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

import contextlib  # noqa: E402
import multiprocessing.process  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

from drgrpo_jax.host_memory import mapped_fraction  # noqa: E402

from support.tiny_models import write_tiny_llama  # noqa: E402
from support.trainer_runs import write_prompts  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Shared inputs, built once per session
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The folder of support.tiny_models.write_tiny_llama's default model (seed 0, vocab 51): read-only for tests."""
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny_model") / "model"))


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> str:
    """40 arithmetic prompts as JSONL (support.trainer_runs.write_prompts): read-only for tests."""
    return write_prompts(str(tmp_path_factory.mktemp("prompts") / "prompts.jsonl"), 40)


# ---------------------------------------------------------------------------------------------
# Markers: slow and heavy run only where -m asks for them; a test that starts a process must say so
# ---------------------------------------------------------------------------------------------


def pytest_collection_modifyitems(config, items):
    """Three tiers, chosen by -m, and the GPU checks. Plain `pytest` (CI, the README) runs everything but `slow`
    and `gpu`. Any -m expression is an inner loop: it leaves out `slow` and `heavy` unless it names them, so
    `-m "not subprocess"` is the quick math-and-model loop, `-m "heavy or not subprocess"` adds the whole-model
    and sharded-step checks, and `-m slow` runs the long ones. `-m gpu` runs the GPU checks (on a GPU)."""
    expr = config.getoption("markexpr", "")

    def left_out(item) -> bool:
        if item.get_closest_marker("gpu"):  # runs only where asked: scripts/gpu_check.sh on a GPU machine
            return "gpu" not in expr
        if item.get_closest_marker("slow"):  # the stronger tag: a slow heavy test is slow
            return "slow" not in expr
        return bool(expr) and "heavy" not in expr and item.get_closest_marker("heavy") is not None

    dropped = [item for item in items if left_out(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not left_out(item)]


def pytest_configure(config):
    """matplotlib (imported by reasoning-gym and the plots) runs `fc-list` the first time it is imported on a
    machine, to build its font cache: pay that here, before the process guard, not inside whichever unmarked
    test imports it first on a fresh machine."""
    with contextlib.suppress(ImportError):
        import matplotlib.font_manager  # noqa: F401


@contextlib.contextmanager
def _no_processes_unless_marked(item):
    """While an unmarked test (or a fixture it sets up) runs, starting a process fails it: the service,
    reward workers, the trainer CLI, notebook kernels and scripts all start through subprocess.Popen or
    multiprocessing."""
    if item.get_closest_marker("subprocess") is not None:
        yield
        return

    def refuse(*args, **kwargs):
        pytest.fail(f"{item.nodeid} starts a process but is not marked subprocess: add @pytest.mark.subprocess "
                    "(or the module's pytestmark)", pytrace=False)

    targets = [(subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start")]
    saved = [(owner, name, owner.__dict__[name]) for owner, name in targets]
    for owner, name in targets:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _no_processes_unless_marked(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _no_processes_unless_marked(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """An xdist worker runs hundreds of test files and jax keeps every program they compile, each holding memory
    mappings (host_memory.mapped_fraction): without this a worker passes Linux's vm.max_map_count late in the suite
    and the compile whose mmap fails segfaults. Past 40% of the limit the worker drops every compiled program; the
    tests after it compile again. Below the service's own 50% (serve/scheduler.py): a service a test left running must
    never drop the programs of a later test in the middle of it."""
    yield
    if mapped_fraction() > 0.4:
        jax.clear_caches()

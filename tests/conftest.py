"""Test-wide JAX settings: 8 CPU devices, rank promotion raises, and strict dtype promotion wherever the code
allows it: everywhere except modules that set ``STRICT_DTYPE_PROMOTION = False`` (optax's Adam bias correction
mixes a Python float with an int32 count, which strict promotion rejects)."""

import atexit
import os
import shutil
import tempfile

from tests.helpers import xla_flags  # imports no jax

# Must be set before jax initialises its backends. The suite is compile-bound: XLA's backend optimisation level 0
# compiles about 20% faster, and the CPU backend's elemental fusion emitters (--xla_cpu_use_fusion_emitters=false)
# compile a tiny model's two-step run in about two thirds of the time of its default MLIR emitters (random bits in a
# quarter); with it (and checkpoints written without a slice per device) the suite took 14.8 minutes against 20.1
# before, on one VM on 2026-11-29. Both compute the same maths (every comparison has a tolerance, or compares two runs
# made under the same flags; tests/faults/test_restore_faults.py checks a bit-exact resume under the defaults users
# run with). Subprocesses inherit the flags.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same tiny programs (in this process and in the CLI subprocesses they start): a persistent
# compilation cache for this session, inherited by the subprocesses, compiles each once. It starts empty, so every
# program is still compiled and checked in every session; only repeats are loaded.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="qkvjax-tests-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# The tests never write into the user's home: TFDS's default data_dir (~/tensorflow_datasets), ~/.cache and the like
# go to a folder of this session, inherited by the subprocesses and removed at the end (QKVJAX_TESTS_KEEP_HOME=1
# keeps the real home, e.g. to reuse a prepared dataset).
if "QKVJAX_TESTS_HOME" not in os.environ and os.environ.get("QKVJAX_TESTS_KEEP_HOME") != "1":
    os.environ["QKVJAX_TESTS_HOME"] = tempfile.mkdtemp(prefix="qkvjax-tests-home-")
    atexit.register(shutil.rmtree, os.environ["QKVJAX_TESTS_HOME"], ignore_errors=True)
    os.environ["HOME"] = os.environ["QKVJAX_TESTS_HOME"]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402

from tests.helpers import GPT2_FILES, SHARED_CORPUS, write_varied_text  # noqa: E402


@pytest.fixture(scope="session")
def corpus() -> str:
    """The real Tiny Shakespeare file beside the repo; its absence fails under CI and skips elsewhere."""
    if SHARED_CORPUS.is_file():
        return str(SHARED_CORPUS)
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but the shared corpus {SHARED_CORPUS} is missing")
    pytest.skip(f"needs the Tiny Shakespeare corpus at {SHARED_CORPUS} (absent in a plain clone)")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> str:
    """One TFDS data_dir for the session, so each builder is prepared once."""
    return str(tmp_path_factory.mktemp("tensorflow_datasets"))


@pytest.fixture(scope="session")
def small_text(tmp_path_factory) -> str:
    """A few KB of varied text made here, for tests that need no real corpus."""
    return write_varied_text(tmp_path_factory.mktemp("text") / "small.txt")


@pytest.fixture(autouse=True)
def _strict_dtype_promotion(request):
    mode = "strict" if getattr(request.module, "STRICT_DTYPE_PROMOTION", True) else "standard"
    with jax.numpy_dtype_promotion(mode):
        yield


# pyproject's 420 s limit catches a hung CI test; a `slow` test is long by design (the soak trains for 20 minutes,
# the kill-at-every-boundary trials run the CLI ~36 times), so it gets an hour unless it names its own limit.
SLOW_TIMEOUT_S = 3600


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


@pytest.fixture(scope="session")
def gpt2_dir() -> str:
    """GPT-2's BPE files beside the repo (../shared/data/gpt2); absent: fail under CI, skip elsewhere."""
    if (GPT2_FILES / "encoder.json").is_file():
        return str(GPT2_FILES)
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but GPT-2's BPE files are missing in {GPT2_FILES}")
    pytest.skip(f"needs GPT-2's encoder.json and vocab.bpe in {GPT2_FILES} (absent in a plain clone)")

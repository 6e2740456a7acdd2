"""Command-line plumbing shared by every subcommand."""

import jax
import pytest

from tests.helpers import REPO, run_in_process


def test_the_persistent_compilation_cache_is_on_by_default_and_can_be_moved_or_turned_off(tmp_path, monkeypatch):
    before = jax.config.jax_compilation_cache_dir
    try:
        assert run_in_process(["--compilation-cache", str(tmp_path / "c"), "schemes"]) == 0
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
        assert run_in_process(["--compilation-cache", "off", "schemes"]) == 0
        assert jax.config.jax_compilation_cache_dir is None
        monkeypatch.setenv("HOME", str(tmp_path))
        assert run_in_process(["schemes"]) == 0  # nothing set: the default under ~/.cache
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / ".cache" / "qkvjax" / "jax")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_the_cli_restores_the_logging_it_quiets(tmp_path):
    """A program (or a test) that calls main() keeps its own absl verbosity, absl logger level and TFDS progress
    bars: the CLI quiets them for its command only."""
    import logging

    from absl import logging as absl_logging
    from tensorflow_datasets.core.utils import tqdm_utils

    absl_logging.set_verbosity(absl_logging.INFO)
    logging.getLogger("absl").setLevel(logging.INFO)
    tqdm_utils.display_progress_bar(True)
    try:
        assert run_in_process(["schemes"]) == 0
        assert run_in_process(["info", f"--workdir={tmp_path}"]) == 2  # an error path too
        assert absl_logging.get_verbosity() == absl_logging.INFO
        assert logging.getLogger("absl").level == logging.INFO
        assert tqdm_utils._active is True
    finally:
        absl_logging.set_verbosity(absl_logging.WARNING)
        logging.getLogger("absl").setLevel(logging.NOTSET)


def test_verbose_shows_the_cause_of_an_error_raised_from_none(tmp_path, capsys):
    import pytest

    config = tmp_path / "broken.py"
    config.write_text("raise RuntimeError('the real cause')\n")
    args = ["train", f"--config={config}", f"--workdir={tmp_path / 'w'}"]
    assert run_in_process(args) == 2
    assert "could not be run as Python" in capsys.readouterr().err  # one line without --verbose
    with pytest.raises(ValueError, match="could not be run as Python") as e:
        run_in_process(["--verbose", *args])
    assert isinstance(e.value.__context__, RuntimeError) and not e.value.__suppress_context__


def test_importing_the_scripts_leaves_sys_path_alone():
    import importlib
    import sys

    before = list(sys.path)
    for name in ("benchmarks.torch_reference", "tests.faults.kill_trials"):  # the two the tests import
        try:
            importlib.import_module(name)
        except ImportError as e:  # an optional extra (torch): the import still ran the module's top
            assert "torch" in str(e), e
    assert sys.path == before


def _leaf_fields(cls, prefix=""):
    import dataclasses
    import typing

    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = next(
            (t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if dataclasses.is_dataclass(t)), None
        )
        out += _leaf_fields(sub, f"{prefix}{f.name}.") if sub else [prefix + f.name]
    return out


def test_train_help_lists_every_config_field_with_type_default_and_meaning(capsys):
    import pytest

    from qkvjax.config import Config, describe_fields
    from tests.helpers import TINY

    rows = describe_fields()
    assert sorted(r["field"] for r in rows) == sorted(_leaf_fields(Config))  # cannot drift from the dataclasses
    assert all(r["meaning"] and r["type"] for r in rows), [r["field"] for r in rows if not r["meaning"]]
    with pytest.raises(SystemExit):
        run_in_process(["train", "--help"])
    text = capsys.readouterr().out
    for row in rows:
        assert f"--config.{row['field']}  {row['type']}" in text, row
    assert "--config.model.d_model  int, default 384" in text
    assert "bool (true/yes/1/false/no/0)" in text  # the accepted spellings
    with pytest.raises(SystemExit):
        run_in_process(["train", f"--config={TINY}", "--config.train.num_steps=7", "--help"])
    text = capsys.readouterr().out
    assert "--config.model.d_model  int, default 32" in text and "--config.train.num_steps  int, default 7" in text


def test_a_config_typo_suggests_the_closest_field(tmp_path, capsys):
    from tests.helpers import TINY

    assert run_in_process(["train", f"--config={TINY}", f"--workdir={tmp_path}", "--config.train.num_step=3"]) == 2
    assert "has no field 'num_step'; did you mean 'num_steps'?" in capsys.readouterr().err


def test_help_says_what_each_command_is_for_and_convert_lists_its_targets(capsys):
    import pytest

    from qkvjax.cli import main

    for argv in (["--help"], ["convert", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "parses arguments and calls the library" not in out
    assert "{shared_qk,shared_kv,bilinear,mla}" in out and "converted to another tying" in out


def test_running_out_of_device_memory_is_one_line_naming_the_allocation(monkeypatch, capsys):
    """XLA's RESOURCE_EXHAUSTED (a real allocation of 4 PiB, made by a command in place of ``schemes``' table) is
    one line with the allocation XLA names; --verbose gives the traceback; other runtime errors stay tracebacks."""
    import jax.numpy as jnp
    import pytest

    import qkvjax.cli

    monkeypatch.setattr(qkvjax.cli, "_schemes", lambda args: jnp.zeros((2**50,), jnp.float32).block_until_ready())
    assert run_in_process(["schemes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qkvjax schemes: error: out of device memory (RESOURCE_EXHAUSTED:")
    assert "4503599627370496 bytes" in err[0] and "`qkvjax plan`" in err[0]
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        run_in_process(["--verbose", "schemes"])


SCRIPTS = sorted(
    str(p.relative_to(REPO))
    for folder in ("launch", "benchmarks", "experiments", "tests/faults")
    for p in (REPO / folder).glob("*.py")
    if 'if __name__ == "__main__":' in p.read_text()
)


# Each script's ``__main__`` in turn, in one fresh interpreter, as ``python SCRIPT --help`` runs it (its folder first
# on sys.path): one import of jax for them all. An interpreter each took 29 s against 6 s (2-core VM beside a
# sweep, 2026-12-02).
HELP_ALL = """
import contextlib, io, json, os, runpy, sys
results, path = {}, list(sys.path)
for script in sys.argv[1:]:
    out, err, before, code = io.StringIO(), io.StringIO(), set(os.listdir(".")), 0
    sys.argv, sys.path[:] = [script, "--help"], [os.path.dirname(script), *path[1:]]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code or 0
        except BaseException as e:
            code = repr(e)
    written = sorted(set(os.listdir(".")) - before)
    results[script] = dict(code=code, stdout=out.getvalue()[:300], stderr=err.getvalue()[-500:], written=written)
sys.__stdout__.write(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps(tmp_path_factory):
    """Every script's answer to --help, from a folder where nothing may be written."""
    import json
    import subprocess
    import sys

    cwd = tmp_path_factory.mktemp("help")
    done = subprocess.run([sys.executable, "-c", HELP_ALL, *(str(REPO / s) for s in SCRIPTS)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {s: json.loads(done.stdout)[str(REPO / s)] for s in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help_with_its_usage_and_does_nothing_else(script, helps):
    """``python SCRIPT --help`` prints a usage line and exits 0 (``mesh_guide.py`` printed its whole table,
    ``report.py`` exited 2), and writes nothing in the folder it runs from."""
    got = helps[script]
    assert got["code"] == 0 and got["stdout"].startswith("usage: "), got
    assert not got["written"], got

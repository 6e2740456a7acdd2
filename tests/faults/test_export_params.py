"""Exporting a step's params again (a finished run started again rewrites ``params/<step>``) is killed (SIGKILL)
at its file boundaries: a whole copy of that step's params survives every kill (the earlier one or the new one),
and the next export leaves exactly the new one. Until 2026-12-01 the earlier copy was removed before the new one
was written, and a kill in between left none."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import REPO

STEP = 5
# runs one export of ``params(1)`` and then a second of ``params(SCALE)``, SIGKILLed at its file boundary N (0: none;
# each boundary printed) by tests/faults/kill_at.py's audit hook
SCRIPT = """
import sys
import jax.numpy as jnp
from qkvjax.workdir import export_params
from tests.faults.kill_at import install

workdir, n, scale, first = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "first"
params = lambda s: {"w_q": jnp.arange(7.0) * s, "mlp": {"w_up": jnp.ones((3, 5)) * s}}
if first:
    export_params(workdir, STEP, params(1.0))
install(n, echo=True)
export_params(workdir, STEP, params(scale))
""".replace("STEP", str(STEP))


def _export(workdir, n: int, scale: float, first: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    env.pop("XLA_FLAGS", None)
    args = [sys.executable, "-c", SCRIPT, str(workdir), str(n), str(scale), "first" if first else "again"]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)


def _restored(folder) -> dict[str, np.ndarray]:
    import orbax.checkpoint as ocp

    from qkvjax.workdir import state_handler

    with ocp.Checkpointer(state_handler()) as ckptr:
        tree = ckptr.restore(folder, args=ocp.args.StandardRestore())
    return {"w_q": np.asarray(tree["w_q"]), "w_up": np.asarray(tree["mlp"]["w_up"])}


def _scale_of(folder) -> float:
    """The scale the params in ``folder`` were exported with; fails unless the copy is whole and consistent."""
    got = _restored(folder)
    scale = float(got["w_q"][1])
    np.testing.assert_array_equal(got["w_q"], np.arange(7.0) * scale)
    np.testing.assert_array_equal(got["w_up"], np.ones((3, 5)) * scale)
    return scale


def _boundaries(tmp_path) -> list[tuple[int, str, str, str]]:
    """(N, event, path, second argument) of every boundary of a second export, from one run that is not killed."""
    done = _export(tmp_path / "count", 0, 2.0, first=True)
    assert done.returncode == 0, done.stderr
    rows = [line.split("\t") for line in done.stdout.splitlines() if line[:1].isdigit()]
    return [(int(n), event, a, b) for n, event, a, b in rows]


def _kill_then_export_again(tmp_path, n: int) -> None:
    """Kills the second export at boundary ``n``: a whole copy of the step must be left (the first export's, in place
    or moved aside; or the second's); a third export then leaves exactly its own copy."""
    w = tmp_path / f"w{n}"
    killed = _export(w, n, 2.0, first=True)
    assert killed.returncode == -signal.SIGKILL, (n, killed.returncode, killed.stderr[-2000:])
    params = w / "params"
    target = params / str(STEP)
    if target.exists():
        assert _scale_of(target) in (1.0, 2.0), n
    else:  # killed between the two renames: the first export's copy is aside, whole
        assert _scale_of(params / f".{STEP}.replaced") == 1.0, (n, os.listdir(params))
    again = _export(w, 0, 3.0, first=False)
    assert again.returncode == 0, again.stderr
    assert os.listdir(params) == [str(STEP)], (n, os.listdir(params))  # the killed attempt's leftovers are gone
    assert _scale_of(target) == 3.0


def test_a_second_export_killed_around_its_renames_leaves_a_whole_copy(tmp_path):
    rows = _boundaries(tmp_path)
    target = str(tmp_path / "count" / "params" / str(STEP))
    aside = next(n for n, event, a, _ in rows if event == "os.rename" and a == target)
    publish = next(n for n, event, _, b in rows if event == "os.rename" and b == target)
    assert publish == aside + 1, rows  # the earlier copy is moved aside only once the new one is whole
    for n in (aside, publish, publish + 1):  # before the earlier copy moves; between the renames; after them
        _kill_then_export_again(tmp_path, n)


@pytest.mark.slow  # ~27 boundaries, two exports in a new process each: 1-3 minutes
def test_a_second_export_killed_at_every_boundary_leaves_a_whole_copy(tmp_path):
    rows = _boundaries(tmp_path)
    assert len(rows) >= 10, rows
    for n, *_ in rows:
        _kill_then_export_again(tmp_path, n)

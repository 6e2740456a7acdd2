"""A reference leak in TensorStore's JSON-to-Python conversion, and a fail-safe way around most of it.

TensorStore's Python bindings turn its C++ JSON values into Python objects in ``JsonToPyObject``
(``python/tensorstore/json_type_caster.cc``; releases 0.1.72 to 0.1.86 tried, all leak). Objects are filled with
``PyDict_SetItem(obj, key.release(), value.release())``: ``PyDict_SetItem`` takes references of its own and does
not steal the caller's, so every key and value of every dict it returns keeps one reference too many and is never
freed. The report to file upstream, with the one-line fix, is ``tests/faults/tensorstore_leak_report.md``.

orbax reaches that conversion in two places on every save: ``ts.experimental_collect_matching_metrics`` (one
dict per TensorStore metric), called by ``tensorstore_utils.get_tensorstore_raw_bytes`` before and after each
batch of arrays only to log a raw-bytes throughput; and ``ts.KvStore.Spec(...).to_json()`` in
``_build_ocdbt_kvstore_tspec``, once per *array*, to resolve the one folder every array of the step goes to (57
calls per save for a small model's parameters and Adam moments: the larger leak in training).

The remedy touches no reference counts and nothing of TensorStore. While a save or restore made through
:mod:`qkvjax.train.checkpoint` is in flight (a *window*):

* orbax's throughput probe answers ``None``, which orbax itself takes as "no raw-bytes figure"
  (``_record_raw_metrics`` returns early), so the metrics call is not made;
* orbax's kvstore spec is built once per folder and options, and each array gets a copy with its own ``path``;
  :func:`install` checks on a probe folder that this copy equals what orbax builds for the array, and wraps
  nothing if it does not.

Outside the windows (a user's own orbax calls in the same process) both run unchanged. If orbax moves, renames or
changes them, nothing is wrapped and the leak is back, never memory corrupted. What remains is one kvstore
resolution per folder per save (``tests/faults/save_probe.py`` for the figures). ``QKVJAX_TENSORSTORE_LEAK_FIX=0``
turns it all off.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import tempfile
import threading

_lock = threading.Lock()
_in_flight: dict[int, int] = {}  # owner id -> open windows (a checkpoint manager's async save, a restore)


def _busy() -> bool:
    return bool(_in_flight)


def open_window(owner: object) -> None:
    """Marks a qkvjax save or restore of ``owner`` (a checkpoint manager) as in flight."""
    with _lock:
        _in_flight[id(owner)] = _in_flight.get(id(owner), 0) + 1


def close_windows(owner: object) -> None:
    """Every window of ``owner`` is over (its saves have finished)."""
    with _lock:
        _in_flight.pop(id(owner), None)
        if not _in_flight:
            _specs.clear()


@contextlib.contextmanager
def window(owner: object):
    open_window(owner)
    try:
        yield
    finally:
        with _lock:
            left = _in_flight.get(id(owner), 0) - 1
            if left > 0:
                _in_flight[id(owner)] = left
            else:
                _in_flight.pop(id(owner), None)
            if not _in_flight:
                _specs.clear()


def _skip_while_busy(probe):
    @functools.wraps(probe)
    def raw_bytes(*args, **kwargs):
        if _busy():
            return None  # orbax: "no raw-bytes figure"; the leaking metrics call is not made
        return probe(*args, **kwargs)

    raw_bytes.__qkvjax_wrapped__ = probe
    return raw_bytes


_specs: dict[tuple, dict] = {}  # (folder, options) -> orbax's kvstore spec without a path, during windows


def _one_resolution_per_folder(build):
    @functools.wraps(build)
    def spec(directory, name=None, **options):
        if not _busy():
            return build(directory, name, **options)
        key = (str(directory), repr(sorted(options.items())))
        with _lock:
            if key not in _specs:
                _specs[key] = build(directory, None, **options)
            out = copy.deepcopy(_specs[key])
        if name is not None:
            out["path"] = name
        return out

    spec.__qkvjax_wrapped__ = build
    return spec


def _copy_is_what_orbax_builds(build) -> bool:
    """On a probe folder: a copy of the spec built without a name, given the array's path, equals orbax's own."""
    try:
        folder = os.path.join(tempfile.gettempdir(), "qkvjax-spec-probe")
        with_name = build(folder, "a.b/c")
        copied = copy.deepcopy(build(folder, None))
        copied["path"] = "a.b/c"
        return with_name == copied
    except Exception:  # another signature or behaviour: leave it alone
        return False


def install() -> list[str]:
    """Wraps orbax's raw-bytes probe where orbax's modules call it (idempotent); returns what this call wrapped.
    Only plain Python attributes of orbax's modules are replaced; nothing of TensorStore's.
    ``QKVJAX_TENSORSTORE_LEAK_FIX=0`` leaves orbax as it is (to measure the leak, or to rule this out)."""
    if os.environ.get("QKVJAX_TENSORSTORE_LEAK_FIX", "1") == "0":
        return []
    try:
        from orbax.checkpoint._src.serialization import jax_array_handlers, tensorstore_utils
    except ImportError:  # another orbax layout: leave everything alone
        return []
    wrapped = []
    for module in (tensorstore_utils, getattr(jax_array_handlers, "ts_utils", None)):
        probe = getattr(module, "get_tensorstore_raw_bytes", None)
        if probe is None or hasattr(probe, "__qkvjax_wrapped__"):
            continue
        module.get_tensorstore_raw_bytes = _skip_while_busy(probe)
        wrapped.append(f"{module.__name__}.get_tensorstore_raw_bytes")
    build = getattr(tensorstore_utils, "_build_ocdbt_kvstore_tspec", None)
    if build is not None and not hasattr(build, "__qkvjax_wrapped__") and _copy_is_what_orbax_builds(build):
        tensorstore_utils._build_ocdbt_kvstore_tspec = _one_resolution_per_folder(build)
        wrapped.append(f"{tensorstore_utils.__name__}._build_ocdbt_kvstore_tspec")
    return wrapped

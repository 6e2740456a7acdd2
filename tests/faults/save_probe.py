"""Resident memory per checkpoint save: ``--saves`` saves of a 13-array state with ``max_to_keep=3``, through
qkvjax's ``checkpoint.save`` or through orbax alone, so growth can be pinned on one or the other
(tests/faults/soak.py shows it is per save, not per step).

    JAX_PLATFORMS=cpu python tests/faults/save_probe.py --variant qkvjax|state_only|sync|no_inventory

``state_only``: orbax's ``StandardSave`` of the state and nothing else; ``sync``: orbax with async saving off;
``no_inventory``: qkvjax's items without its inventory and leftover handling. Prints KiB per save after save 200.
``--trace``: also Python's own allocations (tracemalloc) from save 200 to the end, the lines that grew most: tells
Python objects that pile up from memory held below Python (the allocator, C++ buffers).
``QKVJAX_TENSORSTORE_LEAK_FIX=0`` leaves TensorStore's reference leak in place (qkvjax/train/tensorstore_leak.py):
2026-11-23, 2-core CPU, 1,500 saves: 24.9 KiB per save without the fix, 2.9 with the earlier reference-count fix
(``qkvjax``); 2026-11-24 (machine shared with a sweep), the fail-safe remedy: 3.7 KiB per save, 25.3 without.
"""

import argparse
import gc
import os
import sys
import tempfile
import tracemalloc
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository (or this folder) importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax.numpy as jnp  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from qkvjax.train import checkpoint  # noqa: E402


def rss():
    with open("/proc/self/status") as f:
        for l in f:
            if l.startswith("VmRSS:"):
                return int(l.split()[1]) / 1024


p = argparse.ArgumentParser()
p.add_argument("--saves", type=int, default=1500)
p.add_argument("--variant", default="qkvjax", choices=["qkvjax", "sync", "state_only", "no_inventory"])
p.add_argument("--arrays", type=int, default=12, help="arrays in the saved state (besides the step)")
p.add_argument("--trace", action="store_true", help="tracemalloc: Python allocations that grew after save 200")
a = p.parse_args()
state = {"w": {f"p{i}": jnp.ones((64, 64)) * i for i in range(a.arrays)}, "step": jnp.int32(0)}
with tempfile.TemporaryDirectory() as tmp:
    if a.variant == "sync" or a.variant == "state_only":
        opts = ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=a.variant != "sync")
        handlers = (
            {"state": ocp.StandardCheckpointHandler()}
            if a.variant == "state_only"
            else {
                "state": ocp.StandardCheckpointHandler(),
                "data": ocp.JsonCheckpointHandler(),
                "config": ocp.JsonCheckpointHandler(),
            }
        )
        mngr = ocp.CheckpointManager(os.path.join(tmp, "c"), options=opts, item_handlers=handlers)
    else:
        mngr = checkpoint.manager(tmp)
    base = None
    for i in range(1, a.saves + 1):
        if a.variant == "state_only":
            mngr.save(i, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=True)
            mngr.wait_until_finished()
        elif a.variant == "sync":
            mngr.save(
                i,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=ocp.args.JsonSave({"i": i}),
                    config=ocp.args.JsonSave({"a": 1}),
                ),
                force=True,
            )
            mngr.wait_until_finished()
        elif a.variant == "no_inventory":
            checkpoint._save(mngr, i, state, {"i": i}, {"a": 1})
            mngr.wait_until_finished()
        else:
            checkpoint.save(mngr, i, state, {"i": i}, {"a": 1})
        if i == 200:
            gc.collect()
            base = rss()
            if a.trace:
                tracemalloc.start(8)
                snapshot = tracemalloc.take_snapshot()
        if i % 250 == 0:
            gc.collect()
            print(f"{a.variant} save {i}: rss {rss():.1f} MiB", flush=True)
    checkpoint.close(mngr) if a.variant == "qkvjax" else mngr.close()
    gc.collect()
    end = rss()
    if a.trace:
        grown = tracemalloc.take_snapshot().compare_to(snapshot, "traceback")
        python_growth = sum(st.size_diff for st in grown)
        print(f"python allocations grew {python_growth / 1024:.0f} KiB in all; the largest:")
        for st in grown[:5]:
            print(f"  {st.size_diff / 1024:+.1f} KiB in {st.count_diff:+d} blocks at")
            for line in st.traceback.format()[-6:]:
                print("    " + line)
    print(
        f"{a.variant}: {(end - base) * 1024 / (a.saves - 200):.1f} KiB per save after save 200 "
        f"({base:.0f} -> {end:.0f} MiB)"
    )

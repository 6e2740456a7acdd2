"""Prints launch/README.md's mesh table: for each slice or GPU count and each preset, the first layout that fits.

    python launch/mesh_guide.py

For every (hardware, preset) it tries, in order, plain data parallelism, then FSDP over every device (ZeRO-3:
parameters, gradients and AdamW moments sharded), each first without and then with activation recomputation
(``remat=full``), and keeps the first whose estimated total (``qkvjax plan``) stays under 85% of the device's
memory. The arithmetic per row is ``qkvjax plan --config=FILE --devices N --backend tpu|gpu --config.mesh.data=...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qkvjax.config import MeshConfig, load_config_file  # noqa: E402
from qkvjax.plan import GIB, plan  # noqa: E402

# (name, devices, GiB per device, backend): a TPU chip is one JAX device (v4 and v5p run their two cores as one);
# the backend decides the attention kernel the estimate assumes (a GPU's default: cuDNN's flash kernel)
HARDWARE = [
    ("TPU v4-8", 4, 32, "tpu"),
    ("TPU v4-32", 16, 32, "tpu"),
    ("TPU v5e-16 (v5litepod-16)", 16, 16, "tpu"),
    ("TPU v5p-64", 32, 95, "tpu"),
    ("1 GPU, 80 GB", 1, 80, "gpu"),
    ("8 GPUs, 80 GB", 8, 80, "gpu"),
    ("4 x 8 GPUs, 80 GB", 32, 80, "gpu"),
]
PRESETS = ["gpt2_small", "gpt2_medium"]


def choose(config, devices: int, gib: float, backend: str):
    tries = [
        ("data", MeshConfig(data=-1, fsdp=1, tensor=1), "none"),
        ("fsdp", MeshConfig(data=1, fsdp=-1, tensor=1), "none"),
        ("data", MeshConfig(data=-1, fsdp=1, tensor=1), "full"),
        ("fsdp", MeshConfig(data=1, fsdp=-1, tensor=1), "full"),
    ]
    for _, mesh, remat in tries:
        c = dataclasses.replace(config, mesh=mesh, model=dataclasses.replace(config.model, remat=remat))
        p = plan(c, devices, backend)
        if p.total <= 0.85 * gib * GIB:
            return c, p, True
    return c, p, False


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python launch/mesh_guide.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)  # fmt: skip
    print("| hardware | devices x GiB | preset (batch) | mesh (data, fsdp, tensor) | remat | rows per device | "
          "params + grads + AdamW GiB | activations GiB | total GiB | flags |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, devices, gib, backend in HARDWARE:
        for preset in PRESETS:
            config = load_config_file(str(REPO / "experiments" / "configs" / f"{preset}.py"))
            c, p, ok = choose(config, devices, gib, backend)
            state = (p.params + p.gradients + p.optimizer) / GIB
            flags = f"--config.mesh.data={p.mesh[0]} --config.mesh.fsdp={p.mesh[1]}"
            flags += " --config.model.remat=full" if c.model.remat == "full" else ""
            print(f"| {name} | {devices} x {gib} | {preset} ({c.train.batch_size}) | {p.mesh} | {c.model.remat} | "
                  f"{p.micro_batch} | {state:.2f} | {p.activations / GIB:.2f} | {p.total / GIB:.2f}"
                  f"{'' if ok else ' (does not fit)'} | `{flags}` |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

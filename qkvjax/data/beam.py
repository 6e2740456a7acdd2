"""``qkvjax prepare`` as an Apache Beam pipeline: the same units, the same encoder, the same shards, bit for bit.

    python -m qkvjax.data.beam INPUT... --out DIR --tokenizer FILE|bytes [prepare's options] [-- BEAM OPTIONS]

TFDS prepares the datasets too large for one machine the same way (``tfds build --beam_pipeline_options``). The
plan (:func:`qkvjax.data.prepare.plan`: which sources, cut where, in which unit) is made on the launching machine;
each unit is a Beam element that a worker encodes with :func:`qkvjax.data.prepare.encode_unit` into
``DIR.incomplete/`` and records; the launcher then writes the manifest and renames the folder, as the local run
does. So the output does not depend on the runner, the number of workers or the order they finish in.

Runners (Beam's options after ``--``):

* here, local processes: ``--runner=DirectRunner --direct_running_mode=multi_processing --direct_num_workers=N``
  (the default this module passes);
* Dataflow: ``--runner=DataflowRunner --project=P --region=R --temp_location=gs://B/tmp`` with ``--out gs://...``
  is not supported (shards are written with local file I/O): give a mounted file system (Filestore, a FUSE-mounted
  bucket) as ``--out`` on every worker, and ``--setup_file`` or ``--requirements_file`` naming qkvjax;
* Spark / Flink: ``--runner=SparkRunner`` / ``--runner=FlinkRunner --flink_master=HOST:PORT`` through Beam's
  portable job server, with the inputs and ``--out`` on a file system every worker mounts (NFS, HDFS-FUSE).

Kill and rerun: finished units are kept (their records in ``DIR.incomplete/units/``), as with the local run, and
the local and Beam runs can continue each other's work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


class _EncodeUnits:
    """A Beam DoFn (built when Beam is imported): unit index -> its record, the encoder made once per worker."""

    def __init__(self, plan, work: str):
        self.plan, self.work, self.encode = plan, work, None

    def setup(self) -> None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.encode = self.plan.tokenizer.encoder()

    def process(self, index: int):
        from qkvjax.data.prepare import encode_unit, record_unit

        record = encode_unit(self.plan, index, self.work, self.encode)
        record_unit(self.work, record)
        yield record


def prepare_with_beam(inputs: list[str], out: str, tokenizer: str, *, beam_args: list[str] | None = None,
                      field: str = "text", val_fraction: float = 0.005, seed: int = 0, shard_mb: float = 32,
                      errors: str = "strict", eot: str | None = None, overwrite: bool = False) -> dict:  # fmt: skip
    """:func:`qkvjax.data.prepare.prepare` with the units encoded by a Beam pipeline; returns the manifest."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    from qkvjax.data.corpus_tokenizer import resolve
    from qkvjax.data.prepare import (
        MANIFEST,
        _finished_units,
        check_out,
        finish,
        hash_file,
        plan,
        sources_to_hash,
        start,
    )

    check_out(out)
    the_plan, skipped = plan(inputs, resolve(tokenizer, eot), field, val_fraction, seed, shard_mb, errors)
    started = start(the_plan, out, overwrite)
    if started is None:
        with open(os.path.join(out, MANIFEST)) as f:
            return json.load(f)
    work, done = started
    todo = [i for i in range(len(the_plan.units)) if i not in done]
    args = beam_args if beam_args else ["--runner=DirectRunner", "--direct_running_mode=multi_processing",
                                        f"--direct_num_workers={os.cpu_count() or 1}"]  # fmt: skip
    dofn = type("EncodeUnits", (_EncodeUnits, beam.DoFn), {})(the_plan, work)
    if todo:
        with beam.Pipeline(options=PipelineOptions(args)) as p:
            _ = p | "units" >> beam.Create(todo) | "spread" >> beam.Reshuffle() | "encode" >> beam.ParDo(dofn)
    records = _finished_units(work, len(the_plan.units))
    missing = [i for i in range(len(the_plan.units)) if i not in records]
    if missing:
        raise RuntimeError(f"the Beam pipeline finished without units {missing[:5]}... of {work}; rerun it")
    hashes = {s.name: hash_file(s.path) for s in sources_to_hash(the_plan)}
    return finish(the_plan, work, out, records, hashes, skipped, overwrite)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, beam_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m qkvjax.data.beam", description=__doc__.split("\n\n")[0],
                                epilog="Beam's own options (runner, workers) follow a lone --.")  # fmt: skip
    p.add_argument("inputs", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--field", default="text")
    p.add_argument("--val-fraction", type=float, default=0.005)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mb", type=float, default=32)
    p.add_argument("--errors", default="strict", choices=["strict", "skip"])
    p.add_argument("--eot", default=None)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(ours)
    try:
        m = prepare_with_beam(a.inputs, a.out, a.tokenizer, beam_args=beam_args, field=a.field,
                              val_fraction=a.val_fraction, seed=a.seed, shard_mb=a.shard_mb, errors=a.errors,
                              eot=a.eot, overwrite=a.overwrite)  # fmt: skip
    except (ValueError, OSError) as e:
        print(f"qkvjax.data.beam: error: {e}", file=sys.stderr)
        return 2
    print(f"{a.out}: " + ", ".join(f"{k} {v['tokens']:,} tokens" for k, v in m["splits"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

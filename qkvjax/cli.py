"""The ``qkvjax`` command: parses arguments and calls the library, nothing else."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import threading
import time

from qkvjax import checks

USAGE = """Attention with every Q/K/V tying scheme: train, evaluate, sample, inspect, convert and move models to and
from Hugging Face. Start with `qkvjax train --config FILE --workdir DIR`; `qkvjax COMMAND --help` lists a
command's options; README.md has a first hour."""


def _schemes(args: argparse.Namespace) -> int:
    from qkvjax.attention.costs import cost_table, layout_table
    from qkvjax.attention.layers import MAX_LAYERS, example_layouts

    print(cost_table(args.d_model, args.num_heads, args.seq_len, args.num_kv_heads, args.head_dim, args.dtype))
    if args.num_layers is None and not args.layers:
        return 0
    allowed = f"an integer in [1, {MAX_LAYERS}] (needed by --layers)"  # before example_layouts' lists of layers
    checks.integer_value("--num-layers", args.num_layers, maximum=MAX_LAYERS, allowed=allowed)
    layouts = example_layouts(args.num_layers, args.num_heads)
    for item in args.layers:
        name, sep, pattern = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--layers {item!r}; allowed: NAME=PATTERN, e.g. 'cla2=(separate, [kv_from=-1])*6'")
        layouts[name] = pattern
    print()
    print(layout_table(layouts, args.d_model, args.num_heads, args.num_layers, args.seq_len, args.head_dim, args.dtype))
    return 0


def _distributed(args: argparse.Namespace) -> None:
    """Joins a multi-process run before anything touches a device (auto-detected on TPU VMs, SLURM, Open MPI)."""
    if not (args.distributed or args.coordinator):
        return
    import jax

    if args.coordinator and (args.num_processes is None or args.process_id is None):
        raise ValueError("--coordinator needs --num-processes and --process-id")
    if jax.config.jax_platforms in ("cpu",) or args.cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.distributed_timeout < 1:
        raise ValueError(f"--distributed-timeout={args.distributed_timeout}; allowed: seconds >= 1")
    if args.coordinator_port is not None:
        if not 1 <= args.coordinator_port <= 65535:
            raise ValueError(f"--coordinator-port={args.coordinator_port}; allowed: 1 to 65535")
        os.environ["JAX_COORDINATOR_PORT"] = str(args.coordinator_port)  # read by jax's cluster auto-detection
    # XLA ends a process whose peers do not all join within the timeout with a C++ abort (exit 134, a stack trace
    # and "another task died"); just before that, say what to check in one line and exit 2 instead
    watchdog = threading.Timer(0.95 * args.distributed_timeout, _not_joined, (args,))
    watchdog.daemon = True
    watchdog.start()
    try:
        if args.coordinator:  # qkvjax's own roll call first: XLA aborts every process when an id comes twice
            _roll_call(args)
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=args.distributed_timeout,  # a coordinator that never answers
            heartbeat_timeout_seconds=args.distributed_timeout,  # a peer that died mid-run
        )
    finally:
        watchdog.cancel()


def _roll_call(args: argparse.Namespace) -> None:
    from qkvjax import rollcall

    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--coordinator {args.coordinator}; allowed: HOST:PORT, e.g. 10.0.0.1:1234")
    if not 1 <= args.num_processes <= 65536 or not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--num-processes {args.num_processes} --process-id {args.process_id}; allowed: N >= 1 "
                         "processes, each with its own id from 0 to N - 1")  # fmt: skip
    deadline = time.monotonic() + args.distributed_timeout  # the watchdog says it first, at 0.95 of this
    try:
        if args.process_id == 0:
            rollcall.host_roll_call(int(port), args.num_processes, deadline)
        else:
            rollcall.join_roll_call(host.strip("[]"), int(port), args.num_processes, args.process_id, deadline)
    except TimeoutError:
        _not_joined(args)
    except rollcall.RollCallError as e:
        raise ValueError(f"{e} (this is process {args.process_id} of {args.num_processes})") from None


def _not_joined(args: argparse.Namespace) -> None:
    """The one line for a multi-process start that did not join in time (nothing was written to the workdir)."""
    where = args.coordinator or "the auto-detected coordinator"
    print(
        f"qkvjax: error: the {args.num_processes or 'auto-detected number of'} processes did not all join the "
        f"coordinator {where} within --distributed-timeout={args.distributed_timeout} s (this is process "
        f"{args.process_id if args.process_id is not None else 'auto-detected'}); check that every process was "
        "started, each with the same --num-processes and --coordinator and its own --process-id, and that the "
        "coordinator's port is reachable from every host",
        file=sys.stderr,
        flush=True,
    )
    os._exit(2)


def _train(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    from qkvjax.config import apply_overrides, load_config_file
    from qkvjax.train.loop import train

    _distributed(args)
    config = apply_overrides(load_config_file(args.config), overrides)
    source = config.data.source_path
    if source and "://" not in source and not os.path.isabs(source):  # stored absolute: tools run from anywhere
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, source_path=os.path.abspath(source)))
    train(config, args.workdir, overwrite=args.overwrite)
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from qkvjax.data.prepare import prepare

    manifest = prepare(
        args.inputs, args.out, args.tokenizer, field=args.field, val_fraction=args.val_fraction, seed=args.seed,
        shard_mb=args.shard_mb, workers=args.workers, errors=args.errors, eot=args.eot, overwrite=args.overwrite,
    )  # fmt: skip
    splits = manifest["splits"]
    print(f"{args.out}: " + ", ".join(f"{k} {v['tokens']:,} tokens in {v['documents']:,} documents "
          f"({len(v['shards'])} shards)" for k, v in splits.items()) + f"; {manifest['tokenizer']['kind']} "
          f"tokenizer, V={manifest['tokenizer']['vocab_size']:,}, {manifest['dtype']}"
          + (f"; {len(manifest['skipped'])} files or documents left out (manifest.json: skipped)"
             if manifest["skipped"] else ""))  # fmt: skip
    return 0


def _plan(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    from qkvjax.config import apply_overrides, load_config_file, require_decoder
    from qkvjax.plan import format_plan, plan

    if args.per_device_memory is not None and not args.per_device_memory > 0:
        raise ValueError(f"--per-device-memory={args.per_device_memory}; allowed: GiB > 0")
    config = apply_overrides(load_config_file(args.config), overrides)
    require_decoder(config, "plan")
    print(format_plan(config, plan(config, args.devices, args.backend), args.per_device_memory))
    return 0


def _eval(args: argparse.Namespace) -> int:
    import json

    from qkvjax.evaluate import evaluate
    from qkvjax.workdir import write_text

    _check_outputs(("--output", args.output, False))
    result = evaluate(
        args.workdir, args.step, args.split, args.source_path, args.data_dir, args.stride, args.max_batches,
        batch_size=args.batch_size,
    )  # fmt: skip
    text = json.dumps(result)
    print(text)
    if args.output:
        write_text(args.output, text + "\n")
    return 0


def _check_outputs(*outputs: tuple[str, str | None, bool]) -> None:
    """Each ``(flag, path, is_plot)`` given can be written as named, checked before any work: its folder exists,
    it is not a folder, and a plot's name ends in a format matplotlib writes (``savefig`` adds '.png' to a name
    without one, so the file would not be where the command says it wrote it)."""
    for flag, path, plot in outputs:
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ValueError(f"{flag}={path!r}: folder {folder} does not exist")
        if os.path.isdir(path):
            raise ValueError(f"{flag}={path!r} is a folder; allowed: a file's path in it")
        if plot:
            from matplotlib.backend_bases import FigureCanvasBase

            formats = FigureCanvasBase.get_supported_filetypes()
            if os.path.splitext(path)[1][1:].lower() not in formats:
                raise ValueError(f"{flag}={path!r} names no image format; allowed: a name ending in .png, .svg, .pdf "
                                 f"or another matplotlib writes ({', '.join(sorted(formats))})")  # fmt: skip


def _sample(args: argparse.Namespace) -> int:
    from qkvjax.complete import Request, complete

    fields = {f.name for f in dataclasses.fields(Request)} - {"prompts"}
    complete(Request(prompts=args.prompt, **{k: getattr(args, k) for k in fields}))  # each field is a flag
    return 0


def _info(args: argparse.Namespace) -> int:
    import json

    from qkvjax.info import describe, format_description

    info = describe(args.workdir)
    print(json.dumps(info, indent=2) if args.json else format_description(info))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from qkvjax.convert import CrossLayerError, LayerError, convert_workdir
    from qkvjax.models.encoder import EncoderConfig
    from qkvjax.models.lm import kv_cache_bytes_per_token
    from qkvjax.workdir import load_config

    errors: list = []  # LayerError and CrossLayerError records, in layer order
    out = convert_workdir(
        args.workdir, args.out, args.to, args.num_kv_heads, args.step, args.rank, errors, args.cla, args.rope_dim,
        args.latent_norm,
    )  # fmt: skip
    what = (
        f"rank {args.rank} keeps [W^K, W^V] to a relative error |W - W_R|_F / |W|_F"
        if args.rank is not None
        else "W^Q = W^K keeps the score matrices W^Q (W^K)^T to a relative error"
        if args.to is not None and args.to.startswith("shared_qk")
        else "K = V keeps the value-output maps W^V W^O to a relative error"
    )
    for layer, error in (e for e in errors if isinstance(e, LayerError)):
        print(f"layer {layer}: {what} = {error:.4f}")
    for reader, donor, key_error, value_error in (e for e in errors if isinstance(e, CrossLayerError)):
        print(
            f"layer {reader} reads layer {donor}'s K/V: relative error of its keys {key_error:.4f}, of its "
            f"value-output maps {value_error:.4f} (weights only: it now attends over layer {donor}'s input)"
        )
    if args.latent_norm:
        print("latent norm added (DeepSeek-V2's form), its gains the latent's expected RMS: not exact at any rank")
    before, after = (kv_cache_bytes_per_token(load_config(w).model) for w in (args.workdir, out))
    print(f"KV cache: {before:,} -> {after:,} bytes per token ({after / before:.2f}x)")
    if isinstance(load_config(out).model, EncoderConfig):
        print(f"converted encoder written to {out}; read it with qkvjax info / analyze / export")
    else:
        print(
            f"converted checkpoint written to {out}; uptrain it with: qkvjax train --config {out}/config.json "
            f"--workdir {out} --config.train.num_steps=N (N above the step it starts from)"
        )
    return 0


def _import(args: argparse.Namespace) -> int:
    from qkvjax.hf import import_folder
    from qkvjax.hf.folder import unapplied_generation
    from qkvjax.models.encoder import EncoderConfig, parameter_count
    from qkvjax.sample import describe_sampling
    from qkvjax.workdir import chat_template, sampling_defaults, stop_ids

    config = import_folder(args.folder, args.workdir, args.max_len)
    m = config.model
    encoder = isinstance(m, EncoderConfig)
    kind = " as an encoder (hidden states: info, analyze, convert, export)" if encoder else ""
    stops = () if encoder else stop_ids(args.workdir)
    chat = ", chat template (sample --chat)" if not encoder and chat_template(args.workdir) else ""
    own = describe_sampling(sampling_defaults(args.workdir))
    own = f", samples with {own} (its generation_config.json)" if own and not encoder else ""
    if not encoder and (unapplied := unapplied_generation(args.folder)):
        said = ", ".join(f"{k} {v}" for k, v in unapplied.items())
        print(f"note: {args.folder}'s generation_config.json also sets {said}, which qkvjax sample does not apply: "
              "its tokens can differ from transformers' generate", file=sys.stderr)  # fmt: skip
    print(
        f"imported {args.folder}{kind}: {m.num_layers} layers, D={m.d_model}, N={m.attention.num_heads}, "
        f"K={m.attention.kv_heads}, V={m.vocab_size}, {parameter_count(m):,} parameters, tokenizer "
        f"{config.data.tokenizer or 'bytes'}{f', sampling ends at eos ids {list(stops)}' if stops else ''}{chat}{own} "
        f"-> {args.workdir}"
    )
    return 0


def _export(args: argparse.Namespace) -> int:
    from qkvjax.hf import export_workdir

    fmt = export_workdir(args.workdir, args.folder, args.format, args.step)
    print(f"exported {args.workdir} as a Hugging Face {fmt} model to {args.folder}")
    return 0


def _analyze(args: argparse.Namespace) -> int:
    import json

    from qkvjax.analyze import MAX_RANDOM_SEEDS, analyze_layers, format_report, plot_report
    from qkvjax.sources import FORMATS, load_safetensors, load_workdir
    from qkvjax.workdir import write_text

    if (args.workdir is None) == (args.safetensors is None):
        raise ValueError(f"pass exactly one of --workdir DIR or --safetensors FILE --format {'|'.join(FORMATS)}")
    if args.safetensors is not None and args.format is None:
        raise ValueError(f"--safetensors needs --format; allowed: {', '.join(FORMATS)}")
    if args.workdir is not None:  # a run's config.json says all of these; a silently ignored flag misleads
        given = [f for f, v in (("--format", args.format), ("--label", args.label), ("--num-heads", args.num_heads),
                                ("--num-kv-heads", args.num_kv_heads)) if v is not None]  # fmt: skip
        if given:
            raise ValueError(f"{', '.join(given)} go(es) with --safetensors only; a --workdir's config names its heads")
    elif args.step is not None:
        raise ValueError(f"--step={args.step} goes with --workdir only; a safetensors file holds one set of weights")
    if not 1 <= args.random_seeds <= MAX_RANDOM_SEEDS:  # before the weights are read
        raise ValueError(f"--random-seeds={args.random_seeds}; allowed: an integer in [1, {MAX_RANDOM_SEEDS}]")
    _check_outputs(("--json", args.json, False), ("--plot", args.plot, True))
    if args.workdir is not None:
        layers, source, initial, drift, decay_only = load_workdir(args.workdir, args.step, with_initial=True)
    else:
        layers = load_safetensors(args.safetensors, args.format, args.num_heads, args.num_kv_heads)
        name = args.label or os.path.basename(args.safetensors)
        source, initial, drift, decay_only = f"{name} ({args.format})", None, None, None
    report = analyze_layers(layers, source, args.seed, args.random_seeds, initial, drift, decay_only)
    print(format_report(report))
    if args.json:
        write_text(args.json, json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot_report(report, args.plot)
        print(f"wrote {os.path.abspath(args.plot)}", file=sys.stderr)
    return 0


def _compare(args: argparse.Namespace) -> int:
    import json

    from qkvjax.compare import compare, differences, format_table, plot
    from qkvjax.workdir import json_safe, write_text

    _check_outputs(("--json", args.json, False), ("--plot", args.plot, True))
    rows = compare(args.workdirs)
    print(format_table(rows))
    for note in differences(rows):
        print(note, file=sys.stderr)
    if args.json:
        write_text(args.json, json.dumps(json_safe(rows), indent=2, allow_nan=False) + "\n")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {os.path.abspath(args.plot)}", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _quiet_dependencies():
    """Warnings and errors logged by dependencies that do not concern the user (orbax's read-only manager and
    its background threads, TFDS's builder notes) and TFDS's progress bars are off unless --verbose, for this
    command only: what was set before (by a program calling ``main``, or a test) is restored afterwards."""
    import logging

    from absl import logging as absl_logging
    from tensorflow_datasets.core.utils import tqdm_utils

    verbosity, level, bars = absl_logging.get_verbosity(), logging.getLogger("absl").level, tqdm_utils._active
    # orbax logs each failure of its background save threads (with a traceback) through absl before the error
    # reaches the training loop, which reports it in one line: those logs are only shown with --verbose.
    absl_logging.set_verbosity(absl_logging.FATAL)
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    tqdm_utils.display_progress_bar(False)
    try:
        yield
    finally:
        absl_logging.set_verbosity(verbosity)
        logging.getLogger("absl").setLevel(level)
        tqdm_utils.display_progress_bar(bars)


def split_overrides(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Separates ``--config.a.b=v`` / ``--config.a.b v`` overrides from the other arguments."""
    rest, overrides, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config."):
            key, eq, value = arg[len("--config.") :].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"qkvjax: {arg} needs a value")
                value, i = argv[i + 1], i + 1
            overrides[key] = value
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def _compilation_cache(where: str | None) -> None:
    """JAX's persistent compilation cache (programs that took over a second to compile are kept), so a resumed or
    repeated run skips most of its compile time: ``where``, else $JAX_COMPILATION_CACHE_DIR (which JAX reads
    itself), else ~/.cache/qkvjax/jax; ``"off"`` turns it off."""
    import jax

    if where == "off":
        jax.config.update("jax_compilation_cache_dir", None)
    elif where is not None:
        jax.config.update("jax_compilation_cache_dir", os.path.abspath(os.path.expanduser(where)))
    elif not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/qkvjax/jax"))


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help shows its default, once (not again where the help already names it); an epilog
    that is laid out already (the config field list) is kept as written."""

    def _get_help_string(self, action):
        if (
            "default" in (action.help or "").lower()
            or action.required
            or action.default is None
            or action.default is False
        ):
            return action.help  # said already, or nothing to say (a flag off, an option with no value)
        return super()._get_help_string(action)

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _config_fields_epilog(preset) -> str:
    from qkvjax.config import format_fields

    where = "the --config file's values" if preset is not None else "their defaults (with --config FILE: its values)"
    head = f"config fields: override any with --config.SECTION.FIELD=VALUE; shown with {where}\n\n"
    return head + format_fields(preset, width=100)


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a command, as ``argparse.add_argument`` takes it: its flags (or a positional's name) and
    keywords (``help``, ``type``, ``default``, ``choices``, ``action``, ``metavar``, ``nargs``, ``required``)."""

    flags: tuple[str, ...]
    kwargs: dict


def opt(*flags: str, **kwargs) -> Option:
    return Option(flags, kwargs)


def seed_option(raw: str) -> int:
    """``--seed``'s type: refused by argparse, naming the flag, unless :func:`checks.seed` takes it."""
    try:
        return checks.seed("--seed", int(raw))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r}; allowed: an integer in [0, {checks.SEED_MAX}]") from None


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: its function, one-line ``help``, longer ``description``, options (a tuple of
    :class:`Option`, or ``(title, (Option, ...))`` for an argument group); ``overrides``: it takes ``--config.*``
    overrides (and ``train --config FILE --help`` lists the fields)."""

    name: str
    func: object
    help: str
    options: tuple
    description: str | None = None
    overrides: bool = False


WORKDIR = opt("--workdir", required=True, help="a training run's folder")
STEP = opt("--step", type=int, default=None, help="checkpoint step (None: the newest)")


def commands() -> tuple[Command, ...]:
    """Every subcommand and its options, as data, in ``--help``'s order; :func:`build_parser` builds the parsers."""
    run, tools = (*_run_commands(), *_read_commands()), _tool_commands()
    return (tools[0], *run, *tools[1:])


def _run_commands() -> tuple[Command, ...]:
    """Making a run: train, plan, prepare."""
    return (
        Command("train", _train, "train (or resume) a language model", (
            opt("--config", required=True,
                help="a Python file with get_config(), e.g. experiments/configs/tiny.py, or a run's config.json"),
            opt("--workdir", required=True, help="checkpoints, metrics.jsonl, TensorBoard events, config.json"),
            opt("--overwrite", action="store_true", help="delete a run of another config found in --workdir"),
            ("multi-process (one process per host; see launch/)", (
                opt("--distributed", action="store_true", help="jax.distributed.initialize() with auto-detection"),
                opt("--coordinator", default=None, help="host:port of process 0 (explicit set-up)"),
                opt("--coordinator-port", type=int, default=None,
                    help="port of the auto-detected coordinator with --distributed (default: the platform's, e.g. "
                    "8482 on TPU VMs)"),
                opt("--num-processes", type=int, default=None, help="processes in the run (with --coordinator)"),
                opt("--process-id", type=int, default=None, help="this process's index (with --coordinator)"),
                opt("--cpu-collectives", action="store_true", help="gloo collectives, for multi-process CPU runs"),
                opt("--distributed-timeout", type=int, default=300,
                    help="seconds to wait for the coordinator at start-up, and for a silent peer during the run "
                    "(default 300)"),
            )),
        ), "Train a decoder LM; rerun the same command on the same workdir to resume. Override any config field "
           "with --config.a.b=value (e.g. --config.model.attention.scheme=shared_kv).", overrides=True),
        Command("plan", _plan,
                "memory per device of a config on N devices (parameters, optimizer, gradients, activations)", (
            opt("--config", required=True, help="a Python file with get_config()"),
            opt("--devices", type=int, required=True, help="devices in the job (chips on TPU, GPUs)"),
            opt("--per-device-memory", type=float, default=None, help="GiB per device; warns when it will not fit"),
            opt("--backend", default=None, choices=["cpu", "gpu", "tpu"],
                help="where the run will train, which decides its attention kernels (default: this machine's)"),
        ), "Per-device memory of training a config on a mesh of --devices devices (the config's mesh, e.g. "
           "--config.mesh.fsdp=8; -1 fills the rest). Takes --config.a.b=value overrides like train.",
           overrides=True),
        Command("prepare", _prepare, "tokenize a corpus once, in parallel, into token shards for train", (
            opt("inputs", nargs="+", metavar="INPUT",
                help="text files, folders and globs; .jsonl, .jsonl.gz and .parquet hold a document per record"),
            opt("--out", required=True, help="the prepared corpus' folder (train: --config.data.prepared=OUT)"),
            opt("--tokenizer", required=True,
                help="'bytes', a tokenizer.json, or GPT-2's encoder.json + vocab.bpe (their folder or either file)"),
            opt("--field", default="text", help="the records' text field (jsonl, Parquet)"),
            opt("--val-fraction", type=float, default=0.005, help="the share of documents held out for validation"),
            opt("--seed", type=seed_option, default=0, help="seed of the train/validation split"),
            opt("--shard-mb", type=float, default=32, help="megabytes of input per unit of work (and shard)"),
            opt("--workers", type=int, default=None, help="processes (default: every core)"),
            opt("--errors", default="strict", choices=["strict", "skip"],
                help="a document that is not UTF-8: stop (strict) or leave it out, listed in the manifest (skip)"),
            opt("--eot", default=None,
                help="the separator after each document: for bytes a byte 0-255 (0 when unset), for a tokenizer.json "
                "a token's text (its <|endoftext|>, </s>, ... when unset)"),
            opt("--overwrite", action="store_true", help="replace a corpus (or an unfinished one) of other inputs"),
        ), "Writes OUT/manifest.json, OUT/tokenizer.json and OUT/{train,validation}/NNNNN.bin (raw uint16/uint32 "
           "ids; qkvjax/data/prepare.py says why and how). A killed run resumes its finished units when rerun; OUT "
           "appears only when whole. The same shards through Apache Beam: python -m qkvjax.data.beam --help."),
    )  # fmt: skip


def _read_commands() -> tuple[Command, ...]:
    """Reading a run: eval, sample, info."""
    return (
        Command("eval", _eval, "evaluate a checkpoint on a whole split; prints one JSON object", (
            WORKDIR,
            opt("--step", type=int, default=None, help="checkpoint step (None: the newest that restores)"),
            opt("--split", default="validation", choices=["train", "validation", "test"], help="split to score"),
            opt("--output", default=None, help="also write the JSON here"),
            opt("--source-path", default=None, help="the text file, if it moved since training"),
            opt("--data-dir", default=None, help="the TFDS data_dir, if not the run's"),
            opt("--stride", type=int, default=None,
                help="windows S tokens apart, each scoring its last S targets: every target after the first window "
                "sees at least seq_len - S tokens (Hugging Face's sliding window perplexity), for seq_len / S times "
                "the compute (default: seq_len, windows that do not overlap)"),
            opt("--max-batches", type=int, default=None,
                help="score this many batches of windows spread evenly over the split instead of all of it (a "
                "sample, as training's evaluations take: for a large model on a large split)"),
            opt("--batch-size", type=int, default=None,
                help="windows scored per call (default: the run's training batch); every target is still scored "
                "once, so only the speed changes (on a CPU a larger batch is faster)"),
        )),
        Command("sample", _sample, "generate text from a checkpoint with the KV cache", (
            WORKDIR,
            opt("--prompt", action="append",
                help="text to continue (in the run's tokens, bytes without a tokenizer: prompt + new tokens <= "
                "max_len); repeat it to decode several prompts of any lengths in one batch (one prompt is streamed as "
                "it is made)"),
            opt("--num-tokens", type=int, default=200, help="tokens to generate (bytes without a tokenizer)"),
            opt("--temperature", type=float, default=None,
                help="0 = greedy (default 0.8, or an imported model's own, from its generation_config.json)"),
            opt("--top-k", type=int, default=None, help="0 = no top k cut (default 40, or an imported model's own)"),
            opt("--top-p", type=float, default=None,
                help="nucleus: draw from the fewest likeliest tokens holding this much probability; 1 = no cut "
                "(default 1, or an imported model's own)"),
            opt("--min-p", type=float, default=None,
                help="min p: draw only from tokens at least this many times as likely as the likeliest; 0 = no cut "
                "(default 0, or an imported model's own)"),
            opt("--repetition-penalty", type=float, default=None,
                help="divides the positive logits of the tokens a row has seen (its prompt, what it drew) by this and "
                "multiplies the negative ones, before the cuts, greedy too (transformers' repetition_penalty); 1 = "
                "none (default 1, or an imported model's own)"),
            opt("--seed", type=seed_option, default=0, help="sampling seed"),
            opt("--num-samples", type=int, default=1,
                help="continuations drawn for each prompt, in one batch (transformers' num_return_sequences); the "
                "prompts' common start is read once for every row"),
            opt("--chat", action="store_true",
                help="an imported instruct model: each prompt is a user turn in its chat template (as transformers' "
                "apply_chat_template with add_generation_prompt), so the model answers it"),
            opt("--system", default=None, help="with --chat: a system turn before each prompt"),
            opt("--messages", default=None, metavar="FILE",
                help="with --chat: a JSON list of earlier turns ([{\"role\": \"user\", \"content\": ...}, ...]; - "
                "reads it from standard input) before each prompt; without --prompt, the conversation itself is "
                "answered, or continued when its last turn is the assistant's (continue_final_message)"),
            opt("--interactive", action="store_true",
                help="with --chat: a conversation on standard input, a line per turn, each reply kept for the next ("
                "/reset, /save FILE, /exit); --system and --messages start it"),
            opt("--ignore-eos", action="store_true",
                help="go on past an imported model's end-of-sequence token (by default a row ends at it)"),
            STEP,
        )),
        Command("info", _info, "checkpoints, config, parameters per component and last metrics of a run", (
            WORKDIR,
            opt("--json", action="store_true", help="print JSON instead of text"),
        )),
    )  # fmt: skip


def _tool_commands() -> tuple[Command, ...]:
    """The cost table and the model tools: schemes, convert, analyze, import, export, compare."""
    from qkvjax.convert import TARGETS
    from qkvjax.hf.layouts import LAYOUTS, MODEL_TYPES
    from qkvjax.sources import FORMATS

    analyzable = ", ".join(FORMATS)
    decoders = " or ".join(name for name, layout in LAYOUTS.items() if not layout.encoder)
    encoders = " or ".join(name for name, layout in LAYOUTS.items() if layout.encoder)
    return (
        Command("schemes", _schemes, "parameters, FLOPs and KV-cache bytes of every tying scheme", (
            opt("--d-model", type=int, default=768, help="D, the model width"),
            opt("--num-heads", type=int, default=12, help="N, query heads"),
            opt("--num-kv-heads", type=int, default=None, help="K (default: num_heads)"),
            opt("--head-dim", type=int, default=None, help="H (default: d_model // num_heads)"),
            opt("--seq-len", type=int, default=1024, help="keys each query attends to, for the FLOPs column"),
            opt("--dtype", default="bfloat16", help="cache dtype for the bytes column"),
            opt("--num-layers", type=int, default=None,
                help="L: also compare whole stacks (K = V, GQA, cross-layer K/V...)"),
            opt("--layers", action="append", default=[], metavar="NAME=PATTERN",
                help="a layer pattern to add to the stack table (repeatable; see qkvjax.attention.layers)"),
        )),
        Command("convert", _convert, "convert a checkpoint: another scheme (see --to), GQA, CLA", (
            opt("--workdir", required=True, help="the run to convert"),
            opt("--out", required=True, help="a new (or empty) folder for the converted workdir"),
            opt("--to", default=None, choices=TARGETS,
                help="target scheme (bilinear: exact; shared_kv, shared_qk: least squares; mla: truncated SVD, needs "
                "--rank)"),
            opt("--rank", type=int, default=None,
                help="latent rank R of --to mla (full rank min(D, K(H+Hv)) is exact)"),
            opt("--rope-dim", type=int, default=None,
                help="--to mla of a rotary model: features per head kept rotated (MHA2MLA's partial RoPE, the pairs "
                "of highest frequency; the others lose their rotation: uptrain)"),
            opt("--latent-norm", action="store_true",
                help="--to mla: normalise the latent, as DeepSeek-V2 does (its layout needs it; gains set to the "
                "latent's expected RMS, not exact: uptrain)"),
            opt("--num-kv-heads", type=int, default=None, help="mean-pool kv heads to K (GQA/MQA)"),
            opt("--cla", type=int, default=None, metavar="G",
                help="Cross-Layer Attention: groups of G layers share K/V"),
            STEP,
        ), "Writes a new workdir holding a run's checkpoint converted to another tying scheme (--to), fewer K/V heads "
           "(--num-kv-heads) or cross-layer K/V sharing (--cla), with the approximation error of each changed "
           "projection; exact conversions (bilinear, mla at full rank) compute the same function. Uptrain the result "
           "with `qkvjax train --config OUT/config.json --workdir OUT`."),
        Command("analyze", _analyze,
                "how similar W^Q, W^K, W^V are, per layer, with random and mismatched-head controls", (
            opt("--workdir", default=None, help="a qkvjax training run"),
            opt("--step", type=int, default=None, help="checkpoint step of --workdir (default: the newest)"),
            opt("--safetensors", default=None, help="a .safetensors file in the nn.Linear [out, in] convention"),
            opt("--format", default=None, choices=list(FORMATS), help="tensor layout of --safetensors"),
            opt("--label", default=None, help="what to call --safetensors in the report (default: its file name)"),
            opt("--num-heads", type=int, default=None, help="N (default: from config.json beside the file)"),
            opt("--num-kv-heads", type=int, default=None, help="K for llama (default: config.json, else N)"),
            opt("--json", default=None, help="write the report as JSON here"),
            opt("--plot", default=None,
                help="write a heat map (layers x measures, controls below) here, e.g. WORKDIR/analyze.png (.svg, "
                ".pdf: the name's ending picks the format)"),
            opt("--seed", type=seed_option, default=0, help="seed of the random control (default 0)"),
            opt("--random-seeds", type=int, default=3, help="random draws averaged in the control (default 3)"),
        ), "Basis-invariant similarity of the query, key and value projections of a qkvjax run or of safetensors "
           f"weights ({analyzable} layouts): qk/qv/kv principal-angle cosines, symmetry, trace ratio and effective "
           "rank of W^Q (W^K)^T per head. See qkvjax/analyze.py for the definitions."),
        Command("import", _import, f"a Hugging Face model folder ({', '.join(MODEL_TYPES)}) as a workdir", (
            opt("folder", help="a Hugging Face model folder (config.json + model.safetensors)"),
            opt("--workdir", required=True, help="a new workdir"),
            opt("--max-len", type=int, default=None, help="context of a rotary model (default: its config's)"),
        ), "Reads config.json and the safetensors weights (sharded or not; no torch) into an ordinary workdir: "
           "config.json, params/0 and the folder's tokenizer.json. eval, sample, info, analyze and convert read it; "
           "train --workdir OUT --config OUT/config.json uptrains from it. BERT becomes an encoder (hidden states, no "
           "LM head): info, analyze, convert and export read it; eval, sample and train refuse it."),
        Command("export", _export,
                f"a workdir's model as a Hugging Face folder ({decoders} layout; {encoders} for an imported encoder)", (
            opt("folder", help="a new folder for the Hugging Face model"),
            opt("--workdir", required=True, help="the run to export"),
            opt("--format", default=None, choices=list(LAYOUTS),
                help="default: the first of these layouts that expresses the model"),
            STEP,
        ), "Writes config.json and model.safetensors that transformers' from_pretrained loads. Tied projections are "
           "written out per role (the same function, without the tie's savings). MLA exports as deepseek_v2, QK-norm "
           "as qwen3, K = V full layers and cross-layer K/V as gemma4; what no layout expresses (bilinear, "
           "reformer_qk, ...) is refused in one line naming the layouts tried."),
        Command("compare", _compare,
                "several runs side by side: scheme, params, KV cache, losses, speed; validation curves as PNG", (
            opt("workdirs", nargs="+", metavar="DIR", help="workdirs of training runs"),
            opt("--plot", default=None,
                help="write the loss curves (against step and time) here, e.g. runs/compare.png (.svg, .pdf: the "
                "name's ending picks the format)"),
            opt("--json", default=None, help="write the rows (and curves) as JSON here"),
        )),
    )  # fmt: skip


def build_parser(preset=None) -> argparse.ArgumentParser:
    """The CLI, built from :func:`commands`; ``preset`` (a Config) gives ``train --help``'s field list its values."""
    from qkvjax import __version__

    parser = argparse.ArgumentParser(prog="qkvjax", description=USAGE)
    parser.add_argument("--version", action="version", version=f"qkvjax {__version__}")
    parser.add_argument(
        "--verbose", action="store_true", help="tracebacks of errors, dependency warnings, dataset progress bars"
    )
    parser.add_argument(
        "--compilation-cache",
        default=None,
        metavar="DIR",
        help="JAX's persistent compilation cache: a rerun loads its compiled programs instead of compiling them "
        "again (default: $JAX_COMPILATION_CACHE_DIR, else ~/.cache/qkvjax/jax; 'off' to disable)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in commands():
        extra = {} if command.description is None else {"description": command.description}
        if command.name == "train":
            extra["epilog"] = _config_fields_epilog(preset)
        # Every option's help shows its default.
        p = sub.add_parser(command.name, help=command.help, formatter_class=_HelpFormatter, **extra)
        for item in command.options:
            if isinstance(item, Option):
                p.add_argument(*item.flags, **item.kwargs)
                continue
            title, options = item
            group = p.add_argument_group(title)
            for option in options:
                group.add_argument(*option.flags, **option.kwargs)
        p.set_defaults(func=command.func, **({"takes_overrides": True} if command.overrides else {}))
    return parser


def _help_preset(rest: list[str], overrides: dict[str, str]):
    """For ``train --config FILE --help``: the config the field list shows (None when it cannot be loaded)."""
    if rest[:1] != ["train"] or not {"-h", "--help"} & set(rest):
        return None
    path = next((a.split("=", 1)[1] for a in rest if a.startswith("--config=")), None)
    if path is None and "--config" in rest[:-1]:
        path = rest[rest.index("--config") + 1]
    from qkvjax.config import apply_overrides, load_config_file

    try:
        return apply_overrides(load_config_file(path), overrides) if path else None
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest, overrides = split_overrides(argv)
    args = build_parser(_help_preset(rest, overrides)).parse_args(rest)
    if overrides and not getattr(args, "takes_overrides", False):
        raise SystemExit(f"qkvjax {args.command}: --config.* overrides are not taken here")
    light = args.command in LIGHT_COMMANDS
    if not light:
        _compilation_cache(args.compilation_cache)
    try:
        with contextlib.nullcontext() if args.verbose or light else _quiet_dependencies():
            if getattr(args, "takes_overrides", False):
                return args.func(args, overrides)
            return args.func(args)
    except Exception as e:  # noqa: BLE001  (sorted out below; anything else is raised again)
        return _failed(args, e)


# Commands that need neither JAX nor TFDS: they start without importing them (prepare's own start-up is its cost).
LIGHT_COMMANDS = ("prepare",)


def _failed(args: argparse.Namespace, e: Exception) -> int:
    """The exit code for ``e``, said in one line; an error of no known kind is raised again (a traceback)."""
    if type(e).__name__ == "Interrupted" and type(e).__module__ == "qkvjax.train.loop":
        # saved and stopped: not a success, so a scheduler or a script reruns it
        print(f"qkvjax {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    if isinstance(e, (ValueError, OSError)):  # bad input, a damaged or full disk: one line (--verbose: the traceback)
        if args.verbose:
            e.__suppress_context__ = False  # an error raised "from None" still shows what caused it
            raise e
        print(f"qkvjax {args.command}: error: {e}", file=sys.stderr)
        return 2
    if type(e).__name__ == "JaxRuntimeError" and "RESOURCE_EXHAUSTED" in str(e) and not args.verbose:
        # out of device memory: XLA's first line (its report of buffers: --verbose)
        first = str(e).strip().splitlines()[0]
        print(f"qkvjax {args.command}: error: out of device memory ({first}); `qkvjax plan` estimates a training "
              "config's memory per device", file=sys.stderr)  # fmt: skip
        return 2
    raise e


if __name__ == "__main__":
    sys.exit(main())

"""The ``qkvjax`` command: parses arguments and calls the library, nothing else."""

from __future__ import annotations

import argparse
import sys


def _schemes(args: argparse.Namespace) -> int:
    from qkvjax.attention.schemes import cost_table

    print(cost_table(args.d_model, args.num_heads, args.seq_len, args.num_kv_heads, args.head_dim, args.dtype))
    return 0


def _train(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    from qkvjax.train.config import apply_overrides, load_config_file
    from qkvjax.train.loop import train

    config = apply_overrides(load_config_file(args.config), overrides)
    train(config, args.workdir, overwrite=args.overwrite)
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qkvjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("schemes", help="parameters, FLOPs and KV-cache bytes of every tying scheme")
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--num-heads", type=int, default=12)
    p.add_argument("--num-kv-heads", type=int, default=None, help="K (default: num_heads)")
    p.add_argument("--head-dim", type=int, default=None, help="H (default: d_model // num_heads)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", help="cache dtype for the bytes column")
    p.set_defaults(func=_schemes)

    p = sub.add_parser(
        "train",
        help="train (or resume) a language model",
        description="Train a decoder LM; rerun the same command on the same workdir to resume. "
        "Override any config field with --config.a.b=value (e.g. --config.model.attention.scheme=shared_kv).",
    )
    p.add_argument("--config", required=True, help="a Python file with get_config(), e.g. experiments/configs/tiny.py")
    p.add_argument("--workdir", required=True, help="checkpoints, metrics.jsonl, TensorBoard events, config.json")
    p.add_argument("--overwrite", action="store_true", help="delete a run of another config found in --workdir")
    p.set_defaults(func=_train, takes_overrides=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest, overrides = split_overrides(argv)
    args = build_parser().parse_args(rest)
    if overrides and not getattr(args, "takes_overrides", False):
        raise SystemExit(f"qkvjax {args.command}: --config.* overrides are not taken here")
    try:
        if getattr(args, "takes_overrides", False):
            return args.func(args, overrides)
        return args.func(args)
    except ValueError as e:
        print(f"qkvjax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The ``qkvjax`` command: parses arguments and calls the library, nothing else."""

from __future__ import annotations

import argparse
import sys


def _schemes(args: argparse.Namespace) -> int:
    from qkvjax.attention.schemes import cost_table

    print(cost_table(args.d_model, args.num_heads, args.seq_len, args.num_kv_heads, args.head_dim, args.dtype))
    return 0


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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"qkvjax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

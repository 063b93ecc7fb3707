"""The `pdserve` command line: parses flags once into typed config and hands each part its own.

Commands: `generate` (one completion on the local engine) and `bench engine` (engine throughput
against transformers). A bad flag or config value exits with status 2 and one line naming it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pdserve.errors import PdserveError


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="Hugging Face model folder (default: tiny built-in)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quantization", default=None, choices=["int8"])
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt with the local engine")
    g.add_argument("prompt")
    _add_model_flags(g)
    g.add_argument("--max-tokens", type=_positive_int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")

    b = sub.add_parser("bench", help="benchmarks that print a table and ratios")
    bsub = b.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="engine tokens/s vs transformers, prefix-cache TTFT")
    _add_model_flags(be)
    be.add_argument("--json", default=None, help="write the results as JSON to this file")
    be.add_argument("--quick", action="store_true", help="smaller workloads (CI smoke run)")
    return parser


def _cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    llm = LLM(
        args.model, dtype=args.dtype, quantization=args.quantization, block_size=args.block_size
    )
    out = llm.generate([args.prompt], params)[0]
    print(args.prompt + out.text)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from pdserve.bench.engine_bench import run_engine_bench

    return run_engine_bench(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pdserve` script."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "bench":
            return _cmd_bench(args)
    except PdserveError as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 2

"""`pdserve generate PROMPT`: one completion on the local engine (the offline `LLM` API)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pdserve.cli.command import add_model_flags, model_config, run
from pdserve.flag_types import positive_int


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    g = argparse.ArgumentParser(prog="pdserve generate", description=__doc__)
    g.add_argument("prompt")
    add_model_flags(g)
    g.add_argument("--max-tokens", type=positive_int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    return g


def _generate(args: argparse.Namespace) -> int:
    from pdserve.llm import LLM
    from pdserve.protocol.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    model = model_config(args)
    llm = LLM(
        model.path,
        dtype=model.dtype,
        quantization=model.quantization,
        device=model.device,
        block_size=args.block_size,
    )
    out = llm.generate([args.prompt], params)[0]
    print(args.prompt + out.text)
    return 0


def main(argv: Sequence[str]) -> int:
    """Run the command; returns the exit status."""
    return run("generate", build_parser(), _generate, argv)

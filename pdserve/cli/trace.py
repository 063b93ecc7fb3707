"""`pdserve trace REQUEST_ID`: one request's timeline as a waterfall (or JSON, or a PNG)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve.cli.command import run
from pdserve.cli.dial import add_tls_flags


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    tr = argparse.ArgumentParser(prog="pdserve trace", description=__doc__)
    tr.add_argument("request_id", help="the id of the OpenAI response (cmpl-…, chatcmpl-…)")
    tr.add_argument("--url", default=None, help="router URL (default: the running `pdserve up`)")
    tr.add_argument("--json", action="store_true", help="print the timeline JSON")
    tr.add_argument(
        "--merged",
        action="store_true",
        help="add the workers' events, aligned to the router's clock",
    )
    tr.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE",
        help="also draw the merged timeline into FILE (PNG; needs pdserve[plot])",
    )
    add_tls_flags(tr)
    return tr


def _trace(args: argparse.Namespace) -> int:
    import json

    from pdserve.cli.dial import dial_with_tls
    from pdserve.cli.status import find_router_url
    from pdserve.observability.trace import fetch_timeline, render_waterfall

    dial_with_tls(args)
    merged = args.merged or args.plot is not None
    view = fetch_timeline(find_router_url(args.url), args.request_id, workers=merged)
    print(json.dumps(view, indent=2) if args.json else render_waterfall(view))
    if args.plot is not None:
        from pdserve.observability.plot import save_plot

        save_plot(view, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def main(argv: Sequence[str]) -> int:
    """Run the command; returns the exit status."""
    return run("trace", build_parser(), _trace, argv)

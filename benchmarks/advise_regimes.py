"""When does the split win on this machine? `pdserve advise` on two workloads, one JSON.

    python benchmarks/advise_regimes.py OUT.json [--duration-s S] [--repeats R] [--only NAME]
        [--plot DIR]

Two `both` workers of the tiny model (one cluster per workload, colocated and 1:1 measured
side by side on the same processes, see `pdserve.advise.command`):

- `split_wins`: long prompts (1800-1990 tokens, near the tiny model's 2048 context), 32-48
  output tokens, a tight TPOT SLO (10 ms). Colocated, a long prefill shares engine steps with
  the other requests' decode tokens (each such step takes the whole prefill's time, ~230 ms on
  a quiet machine), which breaks their mean TPOT; split, decode steps never carry prefill, and
  one prefill worker keeps up at these rates. Outputs of 32-48 tokens spread the handoff gap
  (the KV transfer sits between the first and second token) over enough tokens that the
  split's own TPOT stays inside the SLO;
- `colocated_wins`: short prompts (32-256), long outputs (32-64), TPOT SLO 15 ms, high rates
  (8-32 req/s): interference is small, and the split puts every decode on one worker and pays
  a KV transfer per request, while colocated spreads decode over both. The rates reach well
  past where one decode worker saturates on a fast moment of this machine: with 8-20 req/s a
  fast moment once left both arms inside the SLO (a tie), while at 28 req/s on a quiet machine
  colocated held (TPOT p50 8.8 ms) and the split's one decode worker did not (22 ms).

The SLOs and rates are multiples of a lone request of each workload, measured first on the
same cluster (`--slo-ttft-x` and friends of `pdserve advise`): with absolute SLOs chosen on a
quiet machine, a machine 3-4x slower reproduced neither regime (colocated recommended for both,
the split sustaining no rate). The multiples are those absolute figures over a quiet run's lone
request.

OUT.json holds, per workload, `pdserve advise --json`'s document without the per-request
rows (config, curves, sustained rates, recommendation, `goodput_ratio_disagg_vs_colocated`),
plus the load average of the machine before and after the run (it is shared: figures taken on
a busy machine say so).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from pdserve.advise.calibration import Relative
from pdserve.advise.command import AdviseConfig, report_json, run_advise
from pdserve.advise.goodput import prepare_run
from pdserve.advise.goodput_stats import WorkloadShape
from pdserve.advise.workload import AdviseWorkload
from pdserve.supervise.process import exit_on_sigterm

# Multiples of a lone request of each workload, measured first on the same cluster
# (`pdserve/advise/calibration.py`): the absolute SLOs and rates these regimes were found with
# on a quiet run of this machine (split_wins: TTFT 3 s, TPOT 10 ms, 0.5-3 req/s;
# colocated_wins: 1 s, 15 ms, 8-32 req/s) over what a lone request measured here (split_wins:
# TTFT ~310 ms, TPOT ~3.4 ms, ~0.44 s end to end; colocated_wins: ~20 ms, ~2.0 ms, ~0.11 s), so
# that a slower or busier machine gets SLOs and rates of its own.
REGIMES = {
    "split_wins": (
        WorkloadShape(1800, 1990, 32, 48),
        Relative(ttft_x=10.0, tpot_x=3.0, rates_x=(0.25, 0.5, 1.0, 1.5)),
    ),
    "colocated_wins": (
        WorkloadShape(32, 256, 32, 64),
        Relative(ttft_x=50.0, tpot_x=7.5, rates_x=(0.9, 1.8, 2.6, 3.1, 3.5)),
    ),
}


def main() -> int:
    exit_on_sigterm()  # a SIGTERM stops the clusters it started (their finally blocks)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--duration-s", type=float, default=6.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", choices=sorted(REGIMES), default=None)
    p.add_argument("--plot", type=Path, default=None, help="PNGs into DIR/<workload>/")
    args = p.parse_args()
    prepare_run(args.plot)
    doc: dict[str, object] = {}
    if args.out.exists():
        doc = json.loads(args.out.read_text())
    for name, (shape, relative) in REGIMES.items():
        if args.only is not None and name != args.only:
            continue
        config = AdviseConfig(
            workload=AdviseWorkload(shape=shape),
            num_workers=2,
            duration_s=args.duration_s,
            repeats=args.repeats,
            relative=relative,
        )
        before = os.getloadavg()
        result = run_advise(config)
        after = os.getloadavg()
        report = report_json(result)
        report.pop("requests")
        report["load_average_before_after"] = [before, after]
        doc[name] = report
        if args.plot is not None:
            from pdserve.advise.goodput_plot import save_serve_plots

            save_serve_plots(result.report, result.config.slo, args.plot / name)
        ratios = report["goodput_ratio_disagg_vs_colocated"]
        calibration = report["config"]["calibration"]  # type: ignore[index]
        print(f"{name}: calibrated on {calibration}")
        print(f"{name}: recommendation {report['recommendation']}; split/colocated {ratios}")
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

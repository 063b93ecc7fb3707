"""The PNGs of `pdserve bench serve --plot DIR`, drawn from a finished `ServeReport`.

Three kinds of figure, one line (or curve) per mode:
- `goodput_vs_rate.png`: goodput and SLO attainment against the offered rate;
- `latency_cdf.png`: TTFT and TPOT CDFs at the highest rate, with the SLOs as vertical lines;
- `timeline-<mode>.png`: the phases of that mode's median-latency request at the highest rate
  (`observability.plot.save_plot` on the merged timeline fetched before the cluster stopped).

matplotlib is imported only through `observability.plot.load_pyplot` (the optional extra
`pdserve[plot]`); nothing here measures or talks to a cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.advise.goodput_stats import SLO, cdf
from pdserve.observability.plot import load_pyplot, save_plot

if TYPE_CHECKING:
    from pdserve.advise.goodput import ServeReport


def save_serve_plots(report: ServeReport, slo: SLO, plot_dir: Path) -> list[Path]:
    """Draw every figure into `plot_dir` (created); returns the files written."""
    plt = load_pyplot()
    plot_dir.mkdir(parents=True, exist_ok=True)
    modes = list(dict.fromkeys(s.mode for s in report.summaries))
    written = []

    fig, (good_ax, attain_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in modes:
        rows = sorted((s for s in report.summaries if s.mode == mode), key=lambda s: s.rate)
        rates = [s.rate for s in rows]
        good_ax.plot(rates, [s.goodput_rps for s in rows], marker="o", label=mode)
        attain_ax.plot(rates, [s.attainment for s in rows], marker="o", label=mode)
    top = max((s.rate for s in report.summaries), default=1.0)
    good_ax.plot([0, top], [0, top], color="grey", linestyle=":", label="offered rate")
    good_ax.set(xlabel="offered rate (req/s)", ylabel="goodput (req/s meeting both SLOs)")
    attain_ax.set(xlabel="offered rate (req/s)", ylabel="SLO attainment", ylim=(-0.02, 1.02))
    title = f"SLOs: TTFT <= {slo.ttft_s * 1e3:g} ms, TPOT <= {slo.tpot_s * 1e3:g} ms"
    written.append(_save(plt, fig, title, plot_dir / "goodput_vs_rate.png"))

    fig, (ttft_ax, tpot_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in modes:
        records = report.records.get((mode, top), [])
        ttfts = [r.ttft_s * 1e3 for r in records if r.error is None and r.ttft_s is not None]
        tpots = [t * 1e3 for r in records if (t := r.tpot_s) is not None]
        ttft_ax.step(*cdf(ttfts), where="post", label=mode)
        tpot_ax.step(*cdf(tpots), where="post", label=mode)
    ttft_ax.axvline(slo.ttft_s * 1e3, color="grey", linestyle="--", label="SLO")
    tpot_ax.axvline(slo.tpot_s * 1e3, color="grey", linestyle="--", label="SLO")
    ttft_ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
    tpot_ax.set(xlabel="TPOT (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
    title = f"latency CDFs at {top:g} req/s (completed requests)"
    written.append(_save(plt, fig, title, plot_dir / "latency_cdf.png"))

    for mode, view in report.timelines.items():
        if view:
            path = plot_dir / f"timeline-{mode}.png"
            save_plot(view, path)
            written.append(path)
    return written


def _save(plt: Any, fig: Any, title: str, path: Path) -> Path:
    """Grid and legend on every axis, the title, then the PNG at `path`."""
    for ax in fig.axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)  # pyplot keeps every open figure alive otherwise
    return path

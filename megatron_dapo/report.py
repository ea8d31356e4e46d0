"""``dapo report RUN_DIR``: ``run_dir/metrics.jsonl`` -> ``run_dir/report.png``, a grid of curves over step.

One panel per group of metrics present in the log (reward/accuracy, eval avg@k per source, eval pass@k/maj@k,
response length, entropy, clip fractions, PPO KL, rollout-vs-actor logp gap, dynamic sampling, loss, grad norm,
learning rate, timings). Groups with no finite value are left out, so a partial or one-step log still renders.
Drawn with matplotlib's Agg canvas directly (no pyplot, no global backend switch).
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from megatron_dapo.metrics import METRICS_FILE, read_metrics

REPORT_FILE = "report.png"
NCOLS = 3
PANEL_SIZE = (5.2, 3.4)  # inches per grid cell
DPI = 100
SMOOTH_MIN_POINTS = 30  # from this many points on, draw the raw curve faint with an EMA over it
MARKER_MAX_POINTS = 40  # up to this many points, mark each one (so a single step is visible)


@dataclass(frozen=True)
class PanelSpec:
    """One subplot: metrics whose name fully matches ``pattern`` (label = first regex group, or the name).

    ``right``: a second pattern drawn on a twin y-axis (for quantities of another scale).
    """

    title: str
    ylabel: str
    pattern: str
    right: str | None = None
    right_ylabel: str = ""
    smooth: bool = True
    logy: bool = False


PANELS: tuple[PanelSpec, ...] = (
    PanelSpec("Reward / accuracy (train rollouts)", "mean", r"train/((?:reward|acc|score)_mean)"),
    PanelSpec("Eval avg@k", "accuracy", r"eval/(.+)/avg@\d+", smooth=False),
    PanelSpec("Eval pass@k / maj@k", "fraction of problems", r"eval/(.+/(?:pass|maj|format)@\d+)", smooth=False),
    PanelSpec(
        "Response length",
        "tokens per response",
        r"train/(response_len\w*)",
        right=r"train/(logp_gap_tokens)",  # the tokens the gap was measured on: a count, not nats
        right_ylabel="response tokens per step",
    ),
    PanelSpec("Entropy", "nats / token", r"train/(entropy\w*)"),
    PanelSpec("Clip fractions", "fraction of tokens", r"train/(clip_frac\w*)"),
    PanelSpec("PPO KL (old -> new)", "KL", r"train/(ppo_kl\w*)"),
    # The gap is ~1e-7 on CPU and ~1e-2 in bf16/FP8: a log scale shows both; exact zeros go on a linear band.
    PanelSpec("Logp gap |rollout - actor|", "nats / token", r"train/(logp_gap_(?:mean|max))", logy=True),
    PanelSpec(
        "Dynamic sampling",
        "kept groups",
        r"train/(kept_groups)",
        right=r"train/(num_gen_batches)",
        right_ylabel="generation batches",
        smooth=False,
    ),
    PanelSpec("Loss", "loss", r"train/(loss)"),
    PanelSpec("Grad norm", "L2 norm (before clipping)", r"train/(grad_norm)", logy=True),
    PanelSpec("Learning rate", "lr", r"train/(lr)", smooth=False),
    PanelSpec("Timings per step", "seconds", r"time/(.+)_s", smooth=False),
    PanelSpec("Memory (rank 0)", "GiB", r"mem/(rss_peak|children_rss)_gib", smooth=False),
)


def _series(records: list[dict], pattern: str) -> list[tuple[str, str, list[int], list[float]]]:
    """``(key, label, steps, values)`` for every metric name matching ``pattern`` that has a finite value."""
    regex = re.compile(pattern)
    keys = sorted({k for r in records for k in r if k != "step" and regex.fullmatch(k)})
    out = []
    for key in keys:
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if pts:
            m = regex.fullmatch(key)
            label = m.group(1) if m.groups() else key
            out.append((key, label, [p[0] for p in pts], [float(p[1]) for p in pts]))
    if pattern.startswith("time/"):  # the whole step first, then its parts
        out.sort(key=lambda s: (s[1] != "step", s[1]))
    return out


def _ema(values: list[float], weight: float = 0.9) -> list[float]:
    """Debiased exponential moving average (as tensorboard's smoothing)."""
    out, acc, norm = [], 0.0, 0.0
    for v in values:
        acc = weight * acc + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(acc / norm)
    return out


def _draw(ax, series, smooth: bool, color_offset: int = 0, linestyle: str = "-") -> list:
    """Plot each series; labels ``src/pass@k`` and ``src/maj@k`` share the colour of ``src`` (maj dashed)."""
    handles, colors = [], {}
    for _key, label, steps, values in series:
        group = label.rsplit("/", 1)[0]
        color = colors.setdefault(group, f"C{(len(colors) + color_offset) % 10}")
        if label == "step":  # total step time: emphasized
            color = "black"
        style = "--" if "/maj@" in label else linestyle
        marker = "o" if len(steps) <= MARKER_MAX_POINTS else None
        if smooth and len(steps) >= SMOOTH_MIN_POINTS:
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8, linestyle=style)
            (h,) = ax.plot(steps, _ema(values), color=color, linewidth=1.6, linestyle=style, label=f"{label} (EMA)")
        else:
            (h,) = ax.plot(
                steps, values, color=color, linewidth=1.4, linestyle=style, marker=marker, markersize=3.5, label=label
            )
        handles.append(h)
    return handles


def _log_scale(ax, values: list[float]) -> None:
    """Log y-axis; with zeros among the values (an exact match), symlog with a linear band below the smallest
    positive value, so the zeros stay on the plot instead of vanishing."""
    positive = [v for v in values if v > 0]
    if not positive:
        return
    if len(positive) == len(values):
        ax.set_yscale("log")
    else:
        ax.set_yscale("symlog", linthresh=min(positive))


def plot_metrics(records: list[dict], title: str = "") -> Figure:
    """The report figure for ``records`` (as returned by ``read_metrics``); one titled subplot per group present."""
    panels = [
        (spec, _series(records, spec.pattern), _series(records, spec.right) if spec.right else []) for spec in PANELS
    ]
    panels = [p for p in panels if p[1] or p[2]]
    n = max(1, len(panels))
    ncols = min(NCOLS, n)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(PANEL_SIZE[0] * ncols, PANEL_SIZE[1] * nrows + 0.6), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    steps = [r["step"] for r in records]
    if not steps:
        span = "no steps logged"
    elif len(steps) == 1:
        span = f"step {steps[0]}"
    else:
        span = f"steps {min(steps)}-{max(steps)} ({len(steps)} logged)"
    fig.suptitle(f"{title}  —  {span}" if title else span, fontsize=13)
    if not panels:
        ax = fig.add_subplot(1, 1, 1)
        ax.text(0.5, 0.5, "no known metrics to plot", ha="center", va="center", fontsize=12)
        ax.set_axis_off()
        return fig
    for idx, (spec, left, right) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, idx + 1)
        handles = _draw(ax, left, spec.smooth)
        ax.set_title(spec.title, fontsize=11)
        ax.set_xlabel("step")
        ax.set_ylabel(spec.ylabel)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if steps and max(steps) - min(steps) < 2:  # one or two steps: widen, so the ticks are whole steps
            ax.set_xlim(min(steps) - 1, max(steps) + 1)
        if spec.logy:
            _log_scale(ax, [v for s in left for v in s[3]])
        if right:  # twin axis: each y label takes its curve's colour instead of a legend over the data
            ax2 = ax.twinx()
            right_handles = _draw(ax2, right, spec.smooth, color_offset=len(left), linestyle="-")
            ax2.set_ylabel(spec.right_ylabel)
            for axis, hs in ((ax, handles), (ax2, right_handles)):
                if len(hs) == 1:
                    axis.yaxis.label.set_color(hs[0].get_color())
                    axis.tick_params(axis="y", colors=hs[0].get_color())
            if len(left) > 1 or len(right) > 1:
                handles += right_handles
            else:
                handles = []
        if len(handles) > 1:
            ax.legend(handles=handles, labels=[h.get_label() for h in handles], fontsize=8, loc="best")
    return fig


def make_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Read ``run_dir/metrics.jsonl`` (or a metrics file given directly) and write ``report.png`` next to it."""
    run_dir = Path(run_dir)
    metrics_path = run_dir if run_dir.is_file() else run_dir / METRICS_FILE
    records = read_metrics(metrics_path)
    out = Path(out) if out is not None else metrics_path.parent / REPORT_FILE
    title = metrics_path.parent.resolve().name
    fig = plot_metrics(records, title=title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dapo report", description="Plot a run's metrics.jsonl as report.png")
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl (or the metrics file itself)")
    parser.add_argument("--out", default=None, help="output PNG (default: RUN_DIR/report.png)")
    args = parser.parse_args(argv)
    print(make_report(args.run_dir, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

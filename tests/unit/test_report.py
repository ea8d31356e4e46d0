"""report.py: metrics.jsonl -> report.png, one subplot per metric group present; robust to one step / missing keys."""

from __future__ import annotations

import math

import numpy as np
import pytest
from matplotlib.image import imread

from megatron_dapo.metrics import MetricsLogger, read_metrics
from megatron_dapo.report import DPI, NCOLS, PANEL_SIZE, main, make_report, plot_metrics

# The metric groups a trainer logs, as (subplot title, metric names); titles are what the figure must show.
GROUPS = {
    "Reward / accuracy": ["train/reward_mean", "train/acc_mean"],
    "Eval avg@k": ["eval/aime-2024/avg@32", "eval/add2/avg@32"],
    "Eval pass@k / maj@k": ["eval/aime-2024/pass@32", "eval/aime-2024/maj@32"],
    "Response length": ["train/response_len_mean"],
    "Entropy": ["train/entropy"],
    "Clip fractions": ["train/clip_frac_high", "train/clip_frac_low"],
    "PPO KL": ["train/ppo_kl"],
    "Logp gap": ["train/logp_gap_mean"],
    "Dynamic sampling": ["train/kept_groups", "train/num_gen_batches"],
    "Loss": ["train/loss"],
    "Grad norm": ["train/grad_norm"],
    "Learning rate": ["train/lr"],
    "Timings": ["time/step_s", "time/rollout_s", "time/train_s", "time/sync_s"],
    "Memory": ["mem/rss_peak_gib", "mem/children_rss_gib"],
}


def synthetic_metrics(steps: int = 80, eval_every: int = 10, seed: int = 0) -> list[tuple[int, dict]]:
    """A plausible DAPO run: accuracy climbs, length grows, entropy falls; evals every ``eval_every`` steps."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(1, steps + 1):
        t = s / steps
        acc = 0.3 + 0.4 * t + rng.normal(0, 0.03)
        m = {
            "train/acc_mean": acc,
            "train/reward_mean": 2 * acc - 1,
            "train/response_len_mean": 300 + 400 * t + rng.normal(0, 20),
            "train/entropy": 0.8 - 0.3 * t + rng.normal(0, 0.02),
            "train/clip_frac_high": 0.002 + rng.random() * 0.001,
            "train/clip_frac_low": 0.001 + rng.random() * 0.001,
            "train/ppo_kl": 1e-4 * (1 + rng.random()),
            "train/logp_gap_mean": 0.01 + rng.random() * 0.005,
            "train/kept_groups": 512.0,
            "train/num_gen_batches": float(1 + int(3 * t) + rng.integers(0, 2)),
            "train/loss": rng.normal(0, 0.01),
            "train/grad_norm": 0.2 + rng.random() * 0.1,
            "train/lr": 1e-6 * min(1.0, s / 20),
            "time/rollout_s": 60 + rng.random() * 10,
            "time/train_s": 40 + rng.random() * 5,
            "time/sync_s": 3 + rng.random(),
            "mem/rss_peak_gib": 7.0 + t,
            "mem/children_rss_gib": 2.5,
        }
        m["time/step_s"] = m["time/rollout_s"] + m["time/train_s"] + m["time/sync_s"] + 1.0
        if s % eval_every == 0 or s == 1:
            m["eval/aime-2024/avg@32"] = 0.1 + 0.3 * t
            m["eval/aime-2024/pass@32"] = min(1.0, 0.4 + 0.4 * t)
            m["eval/aime-2024/maj@32"] = 0.15 + 0.3 * t
            m["eval/add2/avg@32"] = 0.4 + 0.5 * t
        out.append((s, m))
    return out


def _write(run_dir, entries):
    with MetricsLogger(run_dir, tensorboard=False) as logger:
        for step, m in entries:
            logger.log(step, m)


def _titled_axes(fig):
    return [ax for ax in fig.axes if ax.get_title()]  # twin y-axes carry no title


def _panel(fig, title_prefix):
    (ax,) = [ax for ax in _titled_axes(fig) if ax.get_title().startswith(title_prefix)]
    return ax


@pytest.mark.timeout(120)
def test_report_png_has_one_panel_per_group(tmp_path):
    entries = synthetic_metrics()
    _write(tmp_path, entries)
    path = make_report(tmp_path)
    assert path == tmp_path / "report.png" and path.stat().st_size > 10_000
    n = len(GROUPS)
    rows = math.ceil(n / NCOLS)
    img = imread(path)
    assert img.shape[:2] == (round((PANEL_SIZE[1] * rows + 0.6) * DPI), round(PANEL_SIZE[0] * NCOLS * DPI))
    assert img[..., :3].std() > 0.05  # not a blank canvas

    fig = plot_metrics(read_metrics(tmp_path))
    titles = [ax.get_title() for ax in _titled_axes(fig)]
    assert len(titles) == n, titles
    for prefix in GROUPS:
        assert sum(t.startswith(prefix) for t in titles) == 1, (prefix, titles)
    for ax in _titled_axes(fig):
        assert ax.get_xlabel() == "step" and ax.get_ylabel(), ax.get_title()

    # the plotted data is the logged data: raw loss curve (drawn first, under its EMA) and the sparse eval points
    loss = _panel(fig, "Loss").get_lines()[0]
    np.testing.assert_allclose(loss.get_xdata(), [s for s, _ in entries])
    np.testing.assert_allclose(loss.get_ydata(), [m["train/loss"] for _, m in entries])
    eval_lines = {line.get_label(): line for line in _panel(fig, "Eval avg@k").get_lines()}
    assert set(eval_lines) == {"aime-2024", "add2"}
    want = [(s, m["eval/add2/avg@32"]) for s, m in entries if "eval/add2/avg@32" in m]
    np.testing.assert_allclose(np.c_[eval_lines["add2"].get_xdata(), eval_lines["add2"].get_ydata()], want)


@pytest.mark.timeout(120)
def test_dropping_a_group_drops_its_panel():
    entries = synthetic_metrics(steps=12, eval_every=5)
    for title in ("Dynamic sampling", "Timings", "Clip fractions", "PPO KL"):
        records = [{"step": s} | {k: v for k, v in m.items() if k not in GROUPS[title]} for s, m in entries]
        titles = [ax.get_title() for ax in _titled_axes(plot_metrics(records))]
        assert len(titles) == len(GROUPS) - 1 and not any(t.startswith(title) for t in titles), (title, titles)
    no_eval = [{"step": s} | {k: v for k, v in m.items() if not k.startswith("eval/")} for s, m in entries]
    titles = [ax.get_title() for ax in _titled_axes(plot_metrics(no_eval))]
    assert len(titles) == len(GROUPS) - 2 and not any(t.startswith("Eval") for t in titles)


@pytest.mark.timeout(120)
def test_one_step_and_missing_keys(tmp_path):
    _write(tmp_path, [(0, {"train/reward_mean": -0.5, "time/step_s": 12.0, "train/entropy": float("nan")})])
    path = make_report(tmp_path)
    assert path.stat().st_size > 0
    fig = plot_metrics(read_metrics(tmp_path))
    titles = [ax.get_title() for ax in _titled_axes(fig)]
    assert len(titles) == 2, titles  # entropy is NaN only: no panel
    (line,) = _panel(fig, "Reward").get_lines()
    assert list(line.get_xdata()) == [0] and list(line.get_ydata()) == [-0.5]
    assert line.get_marker() == "o"  # a single point must be visible
    img = imread(path)
    assert img.shape[:2] == (round((PANEL_SIZE[1] + 0.6) * DPI), round(PANEL_SIZE[0] * 2 * DPI))


@pytest.mark.timeout(120)
def test_nothing_known_still_renders(tmp_path):
    _write(tmp_path, [(1, {"custom/thing": 1.0})])
    assert make_report(tmp_path).stat().st_size > 0
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    assert make_report(tmp_path / "empty").stat().st_size > 0
    with pytest.raises(FileNotFoundError, match="nothere"):
        make_report(tmp_path / "nothere")


@pytest.mark.timeout(120)
def test_main_prints_the_path(tmp_path, capsys):
    _write(tmp_path, synthetic_metrics(steps=3))
    out = tmp_path / "sub" / "r.png"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out) and out.stat().st_size > 0


@pytest.mark.timeout(120)
def test_logp_gap_is_visible_on_a_log_scale_and_token_counts_live_elsewhere():
    """A CPU run logs a gap of ~1e-7 nats beside ~6,000 tokens: on one linear axis the gap is a flat line at 0."""
    rng = np.random.default_rng(0)
    records = [
        {
            "step": s,
            "train/response_len_mean": 20.0 + s,
            "train/logp_gap_mean": float(6e-7 * (1 + rng.random())),
            "train/logp_gap_max": float(4e-4 * (1 + rng.random())),
            "train/logp_gap_tokens": 6000.0 + s,
        }
        for s in range(1, 11)
    ]
    fig = plot_metrics(records)
    gap = _panel(fig, "Logp gap")
    assert gap.get_yscale() == "log"
    assert {line.get_label() for line in gap.get_lines()} == {"logp_gap_mean", "logp_gap_max"}
    low, high = gap.get_ylim()
    assert low < 6e-7 and high < 1e-2  # the mean's curve is inside the axis, not squashed under a token count
    # the token count is drawn on the response-length panel's own (twin) axis
    twins = [ax for ax in fig.axes if not ax.get_title() and ax.get_ylabel() == "response tokens per step"]
    assert len(twins) == 1 and [line.get_label() for line in twins[0].get_lines()] == ["logp_gap_tokens"]

    # an exact match (gap 0 on some steps) keeps those points on the plot: symlog, not a log axis that drops them
    records[0]["train/logp_gap_mean"] = 0.0
    assert _panel(plot_metrics(records), "Logp gap").get_yscale() == "symlog"

"""What ``tokenmill bench`` prints and draws: the table, the report, a PNG."""

from __future__ import annotations

import io
import os

from tokenmill.base.errors import TokenmillError
from tokenmill.base.io import atomic_write_bytes

_HEAD = ("contender", "tokens/s", "× naive", "1st batch", "peak RSS", "anon", "data wait",
         "p99 wait", "step slowdown")


def _row(r: dict) -> tuple[str, ...]:
    if "tokens_per_s" not in r:
        return (r["name"], "skipped" if "skipped" in r else "failed") + ("",) * 7
    ratio = f"{r['vs_naive']:,.1f}" if "vs_naive" in r else "-"
    first = r["time_to_first_batch_s"]
    return (r["name"], f"{r['tokens_per_s'] / 1e6:,.2f} M", ratio,
            f"{first * 1e3:,.1f} ms" if first < 1 else f"{first:,.2f} s",
            f"{r['peak_rss_mb']:,.0f} MB", f"{r['peak_anon_mb']:,.0f} MB",
            f"{r['data_wait_pct']:.1f}%",
            f"{r['wait_p99_ms']:,.2f} ms", slowdown_cell(r))


def slowdown_cell(r: dict) -> str:
    """The step slowdown with its noise beside it, marked when within it: "-29.0% ±35.0 noise"."""
    s, noise = r["step_slowdown_pct"], r.get("step_slowdown_noise_pct")
    if noise is None:
        return f"{s:+.1f}%"
    return f"{s:+.1f}% ±{noise:.1f}" + (" noise" if abs(s) <= noise else "")


def format_table(results: list[dict]) -> str:
    """The results as an aligned text table, one row per contender."""
    rows = [_HEAD] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEAD))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                     for row in rows)


def format_report(report: dict) -> str:
    """Command, machine, settings, the table and the notes."""
    m, s = report["machine"], report["settings"]
    lines = [f"$ {report['command']}"] if report.get("command") else []
    lines += [f"machine: {m['cores']} cores ({m['usable_cores']} usable), {m['cpu']}, python "
              f"{m['python']}, numpy {m['numpy']}; load average "
              f"{report['loadavg_before'][0]:.2f} before, {report['loadavg_after'][0]:.2f} after",
              f"store {s['store']}: seq_len {s['seq_len']}, batch {s['batch_size']}, seed "
              f"{s['seed']}; no model for {s['seconds']:g} s; {s['steps']} steps of "
              f"{s['step_ms']:g} ms CPU", "", format_table(report["results"]), "", "notes:"]
    return "\n".join(lines + [f"  - {n}" for n in report["notes"]])


def write_plot(report: dict, path: str | os.PathLike) -> None:
    """A PNG bar chart per contender: tokens/s with no model, data wait %, step slowdown %."""
    try:
        from matplotlib.figure import Figure  # no pyplot: the caller's backend stays as it is
    except ImportError:
        raise TokenmillError("--plot needs matplotlib: pip install 'tokenmill[plot]'") from None
    rows = [r for r in report["results"] if "tokens_per_s" in r]
    names = [r["name"] for r in rows]
    colors = ["#d0833a" if n.startswith("tokenmill") else "#4672b4" for n in names]
    fig = Figure(figsize=(13, 1.6 + 0.4 * len(rows)))
    panels = (("tokens_per_s", 1e-6, "%.3g", "M tokens/s, no model (log scale)"),
              ("data_wait_pct", 1, "%.1f", "data wait % under the step"),
              ("step_slowdown_pct", 1, "%+.1f", "step slowdown %"))
    for ax, (key, scale, fmt, title) in zip(fig.subplots(1, 3, sharey=True), panels):
        ax.bar_label(ax.barh(names, [r[key] * scale for r in rows], color=colors),
                     fmt=fmt, padding=2, fontsize=8)
        ax.margins(x=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log" if key == "tokens_per_s" else "linear")
    fig.axes[0].invert_yaxis()
    s = report["settings"]
    fig.suptitle(f"tokenmill bench: seq_len {s['seq_len']}, batch {s['batch_size']}, step "
                 f"{s['step_ms']:g} ms, {report['machine']['cores']} cores")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    atomic_write_bytes(path, png.getvalue())

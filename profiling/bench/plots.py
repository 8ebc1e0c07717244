"""PNG charts for the benchmark reports (matplotlib's Agg renderer).

Figures are made with `matplotlib.figure.Figure` and an Agg canvas rather than pyplot, so plotting changes no
global backend state and works in a process without a display. The functions take plain data (labels, numbers),
not the benchmark result classes, so each benchmark decides what to plot and this module only how.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .stats import Summary

# A fixed, colour-blind-safe cycle (Okabe-Ito) with enough entries for every start-up phase.
COLORS = (
    "#0072B2",
    "#E69F00",
    "#009E73",
    "#D55E00",
    "#CC79A7",
    "#56B4E9",
    "#F0E442",
    "#000000",
    "#999999",
    "#8C564B",
    "#17BECF",
    "#BCBD22",
    "#7F7F7F",
    "#AEC7E8",
    "#FFBB78",
)


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _spans_decades(values: Sequence[float]) -> bool:
    """A log axis where positive values span more than a factor of 10 (a linear one would flatten the small ones)."""
    positive = [v for v in values if v > 0]
    return bool(positive) and max(positive) > 10 * min(positive)


def plot_latency_vs_batch(
    panels: Mapping[str, Mapping[str, Sequence[tuple[int, Summary]]]],
    path: Path,
    *,
    title: str,
    unit: str = "ms",
) -> Path:
    """One panel per metric (panel title -> series label -> [(batch size, summary)]), x = the batch size that was
    set (log 2): the median with a min-max error bar, and n in the legend. The y axis turns logarithmic where the
    panel's values span more than a decade. A point of one sample gets no bar (its spread is unknown, and a
    zero-width bar would claim one). `title` must say what was measured (model, lengths, dtype)."""
    fig = _figure(5.5 * max(len(panels), 1), 4.8)
    fig.suptitle(f"{title}\nmarker: median; error bars: min–max over the n samples (none where n=1)", fontsize=9)
    for i, (panel, series) in enumerate(panels.items()):
        ax = fig.add_subplot(1, max(len(panels), 1), i + 1)
        for j, (label, points) in enumerate(series.items()):
            if not points:
                continue
            pts = sorted(points, key=lambda p: p[0])
            xs = [b for b, _ in pts]
            medians = [s.p50 for _, s in pts]
            lows = [s.p50 - s.min for _, s in pts]
            highs = [s.max - s.p50 for _, s in pts]
            ns = sorted({s.n for _, s in pts})
            n_text = f"n={ns[0]}" if len(ns) == 1 else f"n={ns[0]}-{ns[-1]}"
            color = COLORS[j % len(COLORS)]
            if any(s.n > 1 for _, s in pts):
                ax.errorbar(
                    xs, medians, yerr=[lows, highs], marker="o", capsize=3, label=f"{label} ({n_text})", color=color
                )
            else:
                ax.plot(xs, medians, marker="o", label=f"{label} (n=1)", color=color)
        ax.set_xscale("log", base=2)
        batches = sorted({b for points in series.values() for b, _ in points})
        if batches:
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.minorticks_off()
        values = [v for points in series.values() for _, s in points for v in (s.min, s.max)]
        log_y = _spans_decades(values)
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel("batch size (sequences, set per run; log 2 axis)")
        ax.set_ylabel(f"{panel} latency ({unit}{', log scale' if log_y else ''})")
        ax.set_title(panel, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        if any(series.values()):
            ax.legend(fontsize=7)
        else:  # an empty panel must not look like a chart of zeros
            ax.text(0.5, 0.5, "no batch size ran (see the report)", transform=ax.transAxes, ha="center")
    return _save(fig, path)


def plot_ranking(
    groups: Mapping[str, Sequence[tuple[str, float, float, float, str | None]]],
    path: Path,
    *,
    xlabel: str = "output tokens/s",
    title: str | None = None,
) -> Path:
    """One horizontal bar panel per group (config -> [(variant label, median, min, max, unusable)]): usable variants
    best at the top, then the unusable ones (`unusable` is the reason, e.g. "unusable: perplexity > 2x bf16", or
    None) as grey hatched bars carrying that text, so a broken format never reads as the winner. Error bars are
    min-max (none where min == max, e.g. one run). Horizontal bars keep long labels readable; the x axis turns
    logarithmic where a panel's values span more than a decade."""
    n = max(len(groups), 1)
    cols = min(n, 2)
    rows = -(-n // cols)
    per_panel = max((len(v) for v in groups.values()), default=1)
    fig = _figure(7.0 * cols, 1.2 + (0.45 * per_panel + 0.9) * rows)
    if title:
        fig.suptitle(title, fontsize=9)
    for i, (panel, entries) in enumerate(groups.items()):
        ax = fig.add_subplot(rows, cols, i + 1)
        usable = sorted((e for e in entries if e[4] is None), key=lambda e: e[1])
        broken = sorted((e for e in entries if e[4] is not None), key=lambda e: e[1])
        ranked = broken + usable  # barh draws bottom-up: the best usable ends on top, the unusable below all
        ys = list(range(len(ranked)))
        for y, e in zip(ys, ranked):
            if e[4] is None:
                ax.barh(y, e[1], color=COLORS[0])
            else:
                ax.barh(y, e[1], color="#DDDDDD", hatch="//", edgecolor="#777777")
                ax.text(max(e[1], e[3]), y, f"  {e[4]}", va="center", ha="left", fontsize=7, color="#B00000")
        spread = [(y, e) for y, e in zip(ys, ranked) if e[3] > e[2]]
        if spread:
            ax.errorbar(
                [e[1] for _, e in spread],
                [y for y, _ in spread],
                xerr=[[e[1] - e[2] for _, e in spread], [e[3] - e[1] for _, e in spread]],
                fmt="none",
                ecolor="black",
                capsize=3,
            )
        ax.set_yticks(ys, [e[0] for e in ranked], fontsize=8)
        log_x = _spans_decades([v for e in ranked for v in (e[2], e[3])])
        if log_x:
            ax.set_xscale("log")
        if broken:  # room on the right for the label of an unusable bar
            ax.set_xlim(right=max(e[3] for e in ranked) * (6.0 if log_x else 1.6))
        ax.set_xlabel(xlabel + (" (log scale)" if log_x else ""), fontsize=8)
        ax.set_title(panel, fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path)


# Phase stacks have up to ~18 segments: 10 distinct colours (tab10) times hatch patterns gives each its own look.
PHASE_HATCHES = ("", "//", "..", "xx")


def phase_style(index: int) -> tuple[str, str]:
    """(colour, hatch) of the index-th phase of a stack: distinct for the first 40 phases."""
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    colour = cmap(index % 10)
    return "#{:02x}{:02x}{:02x}".format(*(round(255 * c) for c in colour[:3])), PHASE_HATCHES[(index // 10) % 4]


def _wrapped(title: str, width_in: float) -> str:
    """The title broken into lines that fit the figure (about 16 characters per inch at fontsize 9)."""
    import textwrap

    width = max(40, int(width_in * 16))
    return "\n".join(textwrap.fill(line, width=width) for line in title.split("\n"))


def plot_phase_stack(
    columns: Sequence[str],
    stacks: Mapping[str, Sequence[float | None]],
    path: Path,
    *,
    title: str,
    xlabel: str,
    totals: Sequence[float] | None = None,
    totals_label: str = "total",
    groups: Sequence[str] | None = None,
    total_spread: Sequence[tuple[float, float]] | None = None,
) -> Path:
    """Stacked bars: one bar per column (a run, a max-model-len), one segment per phase (None = did not run), in
    the order of `stacks`, each phase its own colour and hatch. totals: a black tick per column (e.g. the wall
    time, below the stack when phases overlapped), its value written above the bar; total_spread: (min, max) of
    that total per column, drawn as an error bar (e.g. over repeats). groups: one panel per distinct group (e.g.
    cold, warm), each with its own y scale, so a 1 s warm start is readable beside a 17 s cold one. Segments
    taller than 6% of their panel are labelled with their value."""
    group_of = list(groups) if groups is not None else [""] * len(columns)
    panels = list(dict.fromkeys(group_of))
    width = max(7.5, 0.9 * len(columns) + 2.5 * len(panels) + 3.5)
    fig = _figure(width, 5.4)
    fig.suptitle(_wrapped(title, width - 1.0), fontsize=9)
    drawn: dict[str, Any] = {}
    total_handle = None
    for p, panel in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), p + 1)
        idx = [i for i, g in enumerate(group_of) if g == panel]
        xs = list(range(len(idx)))
        bottoms = [0.0] * len(idx)
        tops = [sum(v or 0.0 for v in (stacks[k][i] for k in stacks)) for i in idx]
        scale = max([*tops, *((totals[i] for i in idx) if totals is not None else ())], default=1.0) or 1.0
        for j, (phase, values) in enumerate(stacks.items()):
            heights = [values[i] or 0.0 for i in idx]
            if not any(heights):
                continue
            colour, hatch = phase_style(j)
            bars = ax.bar(
                xs,
                heights,
                bottom=bottoms,
                label=phase,
                color=colour,
                hatch=hatch,
                width=0.7,
                edgecolor="white",
                linewidth=0.5,
            )
            drawn.setdefault(phase, bars)
            for x, b, h in zip(xs, bottoms, heights):
                if h >= 0.06 * scale:
                    ax.text(
                        x, b + h / 2, f"{h:.2f}", ha="center", va="center", fontsize=6, color="white", fontweight="bold"
                    )
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        if totals is not None:
            ts = [totals[i] for i in idx]
            tick = ax.scatter(xs, ts, marker="_", s=900, linewidths=2.5, color="black", label=totals_label, zorder=3)
            total_handle = tick
            if total_spread is not None:
                lo = [ts[k] - total_spread[i][0] for k, i in enumerate(idx)]
                hi = [total_spread[i][1] - ts[k] for k, i in enumerate(idx)]
                ax.errorbar(xs, ts, yerr=[lo, hi], fmt="none", ecolor="black", capsize=4, zorder=4)
            for x, t, top in zip(xs, ts, bottoms):
                ax.text(x, max(t, top) + 0.02 * scale, f"{t:.2f} s", ha="center", va="bottom", fontsize=7)
        ax.set_ylim(0, 1.12 * max([scale, *bottoms]))
        crowded = len(idx) > 6
        ax.set_xticks(xs, [columns[i] for i in idx], rotation=30 if crowded else 0, ha="right" if crowded else "center")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("seconds")
        if panel:
            ax.set_title(f"{panel} (own scale)", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    if total_handle is not None:
        drawn[totals_label] = total_handle  # last in the legend, after the phases in pipeline order
    fig.legend(list(drawn.values()), list(drawn), fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, format="png", bbox_inches="tight")
    return path


def plot_kv_capacity(
    series: Mapping[str, Sequence[tuple[int, Sequence[float], Sequence[float]]]],
    path: Path,
    *,
    title: str,
) -> Path:
    """KV capacity against max-model-len, two panels: token capacity and max concurrent full-length sequences.
    series: label (e.g. a model) -> [(max-model-len, token capacity per run, max concurrency per run)]. Markers are
    medians over the runs, error bars their min-max (none where n=1); the legend says n."""
    import statistics

    fig = _figure(11.0, 4.6)
    fig.suptitle(_wrapped(f"{title}\nmarker: median over runs; error bars: min–max over runs", 10.0), fontsize=9)
    for p, (ylabel, pick) in enumerate(
        (("KV token capacity (tokens)", 1), ("max concurrent full-length sequences", 2))
    ):
        ax = fig.add_subplot(1, 2, p + 1)
        lengths: set[int] = set()
        for j, (label, points) in enumerate(series.items()):
            pts = sorted((int(pt[0]), [float(v) for v in pt[pick]]) for pt in points if pt[pick])  # type: ignore[misc]
            if not pts:
                continue
            xs = [n for n, _ in pts]
            med = [statistics.median(v) for _, v in pts]
            err = [[m - min(v) for m, (_, v) in zip(med, pts)], [max(v) - m for m, (_, v) in zip(med, pts)]]
            runs = sorted({len(v) for _, v in pts})
            ax.errorbar(
                xs,
                med,
                yerr=err,
                marker="o",
                capsize=3,
                color=phase_style(j)[0],
                label=f"{label} (n={'/'.join(map(str, runs))})",
            )
            for x, m in zip(xs, med):
                ax.annotate(
                    f"{m:,.0f}" if m >= 100 else f"{m:.2f}",
                    (x, m),
                    textcoords="offset points",
                    xytext=(4, 5),
                    fontsize=7,
                )
            lengths.update(xs)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        from matplotlib.ticker import FuncFormatter

        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
        if lengths:
            ax.set_xticks(sorted(lengths), [str(n) for n in sorted(lengths)], rotation=30)
            ax.minorticks_off()
        ax.set_xlabel("max-model-len (tokens, log scale)")
        ax.set_ylabel(f"{ylabel}, log scale")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


LoadPoint = tuple[float, float, float, float, str, int]  # (set load, median, run min, run max, label, runs)


def _load_axis(ax: Any, xs: Sequence[float]) -> None:
    """Log scale (base 2) with a tick at each value once the set loads span a decade or more (1, 8, 32, 64
    clients), so the low points do not collapse onto the axis; a linear axis otherwise."""
    values = sorted({x for x in xs if x > 0})
    if values and values[-1] / values[0] >= 10:
        ax.set_xscale("log", base=2)
        ax.set_xticks(values, [f"{v:g}" for v in values])
        ax.minorticks_off()


def plot_latency_vs_load(
    panels: Mapping[str, Mapping[str, Sequence[LoadPoint]]],
    path: Path,
    *,
    xlabel: str | Mapping[str, str],
    title: str,
    unit: str = "ms",
    columns: int | None = None,
) -> Path:
    """One panel per metric (panel title -> series -> [(load, median, run min, run max, point label, runs)]). The
    load is the variable the benchmark set (clients in flight, an offered request rate), never a measured outcome
    such as the achieved request rate: an outcome can fold back (64 clients achieving fewer req/s than 32) and hide
    the points behind each other. `xlabel`: one label, or one per panel (a closed-loop panel and an open-loop panel
    set different variables). Markers are medians over runs, error bars the min-max over runs; a point of one run
    gets no bar (its spread is unknown, and a zero-width bar would claim one). `title` says what was measured; the
    runs per point (n) are added below it."""
    runs = sorted({p[5] for series in panels.values() for pts in series.values() for p in pts})
    n = "n = " + ("/".join(map(str, runs)) if runs else "0") + " runs per point"
    cols = max(1, min(columns or len(panels), len(panels)))
    rows = -(-max(len(panels), 1) // cols)
    fig = _figure(5.0 * cols, 1.2 + 3.8 * rows)
    fig.suptitle(f"{title}\nmarker: median over runs; error bars: min–max over runs (none where n=1); {n}", fontsize=9)
    for i, (panel, series) in enumerate(panels.items()):
        ax = fig.add_subplot(rows, cols, i + 1)
        for j, (label, points) in enumerate(series.items()):
            if not points:
                continue
            pts = sorted(points)
            xs = [p[0] for p in pts]
            ys = [p[1] for p in pts]
            err = [[p[1] - p[2] if p[5] > 1 else 0.0 for p in pts], [p[3] - p[1] if p[5] > 1 else 0.0 for p in pts]]
            color = COLORS[j % len(COLORS)]
            if any(p[5] > 1 for p in pts):
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label, color=color)
            else:
                ax.plot(xs, ys, marker="o", label=f"{label} (n=1)", color=color)
        _load_axis(ax, [p[0] for pts in series.values() for p in pts])
        ax.set_xlabel(xlabel if isinstance(xlabel, str) else xlabel[panel])
        ax.set_ylabel(f"latency ({unit}, log scale)")
        ax.set_yscale("log")
        ax.set_title(panel, fontsize=9)
        ax.grid(True, alpha=0.3)
        if any(series.values()):
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no load point completed (see the report)", transform=ax.transAxes, ha="center")
    return _save(fig, path)


def plot_overload_pairs(
    phases: Mapping[str, Sequence[float | None]],
    ratios: Sequence[float],
    path: Path,
    *,
    limit: float,
    title: str,
    verdict: str,
    unit: str = "ms",
) -> Path:
    """Two panels for a paired overload verdict. Left: each phase's TTFT p99 per run (one dot per run, joined by a
    grey line within a pair, a bar at the median), so a pair that moved reads as a steep line. Right: each pair's
    ratio (overload / sustainable) as a dot, the median as a bar, and the limit as a red dashed line: the verdict is
    whether every dot sits below the line. Runs without a value (no completed request) are left out of the left
    panel and listed in the right one's title as missing."""
    names = list(phases)
    fig = _figure(10.0, 4.8)
    fig.suptitle(f"{title}\nverdict on the worst pair: {verdict}; n = {len(ratios)} pairs", fontsize=9)
    left = fig.add_subplot(1, 2, 1)
    runs = max((len(v) for v in phases.values()), default=0)
    for i in range(runs):  # a pair's two runs, joined
        ys = [phases[nm][i] if i < len(phases[nm]) else None for nm in names]
        pts = [(x, y) for x, y in enumerate(ys) if y is not None]
        if len(pts) > 1:
            left.plot([p[0] for p in pts], [p[1] for p in pts], color="#999999", linewidth=0.8, zorder=1)
    for x, nm in enumerate(names):
        vals = [v for v in phases[nm] if v is not None]
        left.scatter([x] * len(vals), vals, color=COLORS[x % len(COLORS)], zorder=2, label=f"{nm} (per run)")
        if vals:
            left.hlines(statistics.median(vals), x - 0.25, x + 0.25, color="black", linewidth=2, zorder=3)
    left.set_xticks(list(range(len(names))), names)
    left.set_xlim(-0.6, len(names) - 0.4)
    left.set_ylabel(f"TTFT p99 ({unit})")
    left.set_title("TTFT p99 per run (bar: median; lines join a pair)", fontsize=9)
    left.grid(True, axis="y", alpha=0.3)
    right = fig.add_subplot(1, 2, 2)
    finite = [(i + 1, r) for i, r in enumerate(ratios) if r == r]
    right.scatter([p[0] for p in finite], [p[1] for p in finite], color=COLORS[0], zorder=2, label="pair ratio")
    if finite:
        med = statistics.median(p[1] for p in finite)
        right.axhline(med, color="black", linewidth=1.2, label=f"median {med:.2f}")
    right.axhline(limit, color="#D55E00", linestyle="--", linewidth=1.5, label=f"limit {limit:g}")
    top = max([limit, *(p[1] for p in finite)]) * 1.15
    right.set_ylim(0, top)
    right.set_xticks(list(range(1, len(ratios) + 1)))
    right.set_xlim(0.5, len(ratios) + 0.5)
    right.set_xlabel("pair")
    right.set_ylabel("admitted TTFT p99 / sustainable TTFT p99")
    missing = len(ratios) - len(finite)
    right.set_title("paired ratio" + (f" ({missing} pair(s) without a value)" if missing else ""), fontsize=9)
    right.grid(True, axis="y", alpha=0.3)
    right.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def plot_trace_lanes(trace: Mapping[str, Any], path: Path, *, title: str) -> Path:
    """A trace viewer's picture drawn from a Chrome/Perfetto trace-event object (profiling/export.chrome_trace): one
    row per process (under tensor parallelism, one per rank), each start-up stage a bar from its start to its end,
    coloured by stage, so which rank held READY back and how the ranks overlapped reads at a glance. Made here
    because the Perfetto UI is a web app that a machine with no network cannot load."""
    events = trace.get("traceEvents", [])
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    bars = [e for e in events if e.get("ph") == "X" and e.get("cat") == "startup" and e["name"].count(".") >= 2]
    pids = sorted(names)
    stages = list(dict.fromkeys(e["name"].rsplit(".", 1)[-1] for e in sorted(bars, key=lambda e: e["ts"])))
    fig = _figure(11.0, 1.2 + 0.55 * max(1, len(pids)))
    ax = fig.add_subplot(1, 1, 1)
    for row, pid in enumerate(pids):
        for e in (b for b in bars if b["pid"] == pid):
            stage = e["name"].rsplit(".", 1)[-1]
            ax.barh(
                row,
                e["dur"] / 1e6,
                left=e["ts"] / 1e6,
                height=0.6,
                color=COLORS[stages.index(stage) % len(COLORS)],
                edgecolor="white",
                linewidth=0.4,
            )
    ax.set_yticks(list(range(len(pids))), [names[p] for p in pids])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the first span")
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    from matplotlib.patches import Patch

    ax.legend(
        handles=[Patch(color=COLORS[i % len(COLORS)], label=s) for i, s in enumerate(stages)],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )
    return _save(fig, path)

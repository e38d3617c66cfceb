"""Charts for the HTML reports: matplotlib figures returned as inline SVG strings.

Figures are built with the object API (matplotlib.figure.Figure, no pyplot), so no GUI backend
is ever involved and importing this module changes no global matplotlib state. Every chart is deterministic (fixed `svg.hashsalt`, no Date metadata), carries no network
reference (the XML prolog, DOCTYPE and xmlns attributes are dropped: an <svg> inside HTML needs
none of them), and its element ids are prefixed with the chart's name so that several charts can
share one page. Text stays text (`svg.fonttype = none`): small, selectable, printable.
"""

from __future__ import annotations

import html
import io
import re

import matplotlib
import numpy as np
from matplotlib import ticker
from matplotlib.figure import Figure

# Okabe-Ito colours: distinguishable with the common colour-vision deficiencies.
BLUE, ORANGE, GREEN, VERMILION, GREY, SKY, PURPLE = ("#0072B2", "#E69F00", "#009E73", "#D55E00",
                                                     "#888888", "#56B4E9", "#CC79A7")
RC = {
    "svg.fonttype": "none",
    "text.parse_math": False,  # labels come from data (benchmark, source names): no $...$ math
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "figure.dpi": 96,
}
_ID = re.compile(r'(\bid="|url\(#|href="#)')


def to_svg(fig, name: str, title: str) -> str:
    """Return the SVG of `fig` as an element for inline HTML: ids prefixed with `name`,
    no prolog and no namespace URLs, scaling to its container."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": f"oilbird-{name}"}):
        fig.savefig(buf, format="svg", bbox_inches="tight",
                    metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    head_end = svg.index(">") + 1
    head = svg[:head_end]
    width = re.search(r'width="([\d.]+)pt"', head)
    max_px = round(float(width.group(1)) * 4 / 3) if width else 720
    view_box = re.search(r'viewBox="([^"]+)"', head)
    new_head = (f'<svg class="chart" role="img" aria-label="{_attr(title)}" '
                f'viewBox="{view_box.group(1) if view_box else "0 0 720 360"}" '
                f'style="max-width:{max_px}px" version="1.1">')
    body = _ID.sub(lambda m: m.group(1) + f"{name}-", svg[head_end:])
    return new_head + f"<title>{_attr(title)}</title>" + body


def _attr(text: str) -> str:
    return html.escape(str(text), quote=True)


def _figure(width: float = 7.0, height: float = 3.2, ncols: int = 1, **kw):
    """A figure and its axes; call inside `matplotlib.rc_context(RC)`."""
    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(1, ncols, **kw)


def coverage_chart(keys: list[str], reaches: list[float], only: list[float | None], name: str = "coverage") -> str:
    """Horizontal bars per key: % of available positions it reaches, and % only it reaches."""
    with matplotlib.rc_context(RC):
        fig, ax = _figure(7.0, 0.55 * len(keys) + 1.0)
        y = np.arange(len(keys))
        ax.barh(y - 0.2, reaches, height=0.4, color=BLUE, label="reaches")
        only_vals = [np.nan if v is None else v for v in only]
        ax.barh(y + 0.2, only_vals, height=0.4, color=ORANGE, label="only it")
        for yi, v in zip(y, reaches):
            ax.annotate(f"{v:.1f}", (v, yi - 0.2), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        for yi, v in zip(y, only_vals):
            if not np.isnan(v):
                ax.annotate(f"{v:.1f}", (v, yi + 0.2), xytext=(3, 0), textcoords="offset points", va="center",
                            fontsize=8)
        ax.set_yticks(y, keys)
        ax.invert_yaxis()
        ax.set_xlim(0, 105)
        ax.set_xlabel("% of available positions")
        ax.legend(loc="lower right", frameon=False)
        return to_svg(fig, name, "reaches and only-it per key, % of available positions")


def cliff_chart(success_len: np.ndarray, gap_len: np.ndarray, cap: int = 16, name: str = "cliff") -> str:
    """Share of each population by matched context length; lengths at or above `cap` share the last bar."""
    bins = np.arange(cap + 1)
    with matplotlib.rc_context(RC):
        fig, ax = _figure(7.0, 3.0)
        for values, color, label, shift in ((success_len, BLUE, "oracle successes", -0.2),
                                            (gap_len, VERMILION, "gap positions", 0.2)):
            values = np.clip(np.asarray(values, dtype=np.int64), 0, cap)
            share = 100.0 * np.bincount(values, minlength=cap + 1) / max(1, len(values))
            ax.bar(bins + shift, share, width=0.4, color=color, label=f"{label}, n={len(values):,}")
        ax.set_xticks(bins, [str(b) for b in bins[:-1]] + [f"{cap}+"])
        ax.set_xlabel("longest context suffix found in the pool, tokens")
        ax.set_ylabel("% of the population")
        ax.legend(frameon=False, loc="upper center")
        return to_svg(fig, name, "matched context length at oracle successes and at gap positions")


def rate_bars(labels: list[str], rates: list[float], lows: list[float], highs: list[float],
              xlabel: str, name: str, color_first: str = VERMILION) -> str:
    """Horizontal bars of percentages with interval whiskers (one bar per label)."""
    with matplotlib.rc_context(RC):
        fig, ax = _figure(7.0, 0.5 * len(labels) + 0.9)
        y = np.arange(len(labels))
        r = np.asarray(rates, dtype=float)
        err = np.vstack([r - np.asarray(lows, dtype=float), np.asarray(highs, dtype=float) - r])
        colors = [color_first] + [GREY] * (len(labels) - 1)
        ax.barh(y, r, xerr=np.clip(err, 0, None), color=colors, height=0.6, capsize=3)
        for yi, v, hi in zip(y, r, highs):
            ax.annotate(f"{v:.1f}%", (hi, yi), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
        ax.set_yticks(y, labels)
        ax.invert_yaxis()
        ax.set_xlim(0, max(5.0, float(np.nanmax(highs)) * 1.25 if len(highs) else 5.0))
        ax.set_xlabel(xlabel)
        return to_svg(fig, name, xlabel)


def threshold_chart(thresholds: np.ndarray, recall: np.ndarray, default: float, name: str = "threshold") -> str:
    """Semantic recall over gap positions against the cosine threshold, the default marked."""
    with matplotlib.rc_context(RC):
        fig, ax = _figure(7.0, 3.0)
        ax.plot(thresholds, recall, color=GREEN, lw=2)
        at_default = float(np.interp(default, thresholds, recall))
        ax.axvline(default, color=GREY, ls="--", lw=1)
        ax.plot([default], [at_default], "o", color=VERMILION)
        ax.annotate(f"default {default:g}: {at_default:.1f}%", (default, at_default), xytext=(6, 8),
                    textcoords="offset points", color=VERMILION)
        ax.set_xlim(float(thresholds[0]), float(thresholds[-1]))
        ax.set_ylim(0, 100)
        ax.set_xlabel("cosine threshold on the best neighbour")
        ax.set_ylabel("recall, % of gap positions")
        return to_svg(fig, name, "semantic-key recall against the cosine threshold")


def arm_chart(arms: list[str], tau: list[float], speedup: list[float | None], name: str = "arms") -> str:
    """tau and speedup per decoder arm, side by side."""
    with matplotlib.rc_context(RC):
        fig, (a1, a2) = _figure(7.0, 0.45 * len(arms) + 1.0, ncols=2, sharey=True)
        y = np.arange(len(arms))
        for ax, values, color, label in ((a1, tau, BLUE, "tau (tokens per verification pass)"),
                                         (a2, speedup, GREEN, "speedup over ar")):
            vals = np.array([np.nan if v is None else v for v in values], dtype=float)
            ax.barh(y, vals, color=color, height=0.6)
            for yi, v in zip(y, vals):
                if not np.isnan(v):
                    ax.annotate(f"{v:.2f}", (v, yi), xytext=(3, 0), textcoords="offset points", va="center",
                                fontsize=8)
            ax.set_xlabel(label)
            finite = vals[~np.isnan(vals)]
            ax.set_xlim(0, (finite.max() * 1.25) if finite.size and finite.max() > 0 else 1)
        a1.set_yticks(y, arms)
        a1.invert_yaxis()
        return to_svg(fig, name, "tau and speedup per arm")


def source_chart(arms: list[str], sources: list[str], accepted: list[list[int]], name: str = "sources") -> str:
    """Accepted tokens per source, one stacked bar per arm (a token credited to k sources counts k times)."""
    palette = [BLUE, ORANGE, GREEN, VERMILION, SKY, PURPLE, GREY, "#F0E442", "#000000"]
    with matplotlib.rc_context(RC):
        fig, ax = _figure(7.0, 0.45 * len(arms) + 1.2)
        y = np.arange(len(arms))
        left = np.zeros(len(arms))
        for k, src in enumerate(sources):
            vals = np.array([row[k] for row in accepted], dtype=float)
            ax.barh(y, vals, left=left, color=palette[k % len(palette)], height=0.6, label=src)
            left += vals
        ax.set_yticks(y, arms)
        ax.invert_yaxis()
        ax.set_xlabel("accepted tokens credited to each source")
        ax.legend(frameon=False, ncols=min(4, max(1, len(sources))), loc="upper center",
                  bbox_to_anchor=(0.5, -0.25 if len(arms) < 4 else -0.12))
        return to_svg(fig, name, "accepted tokens per source and arm")


def grid_chart(benches: list[str], series: dict[str, list[float]], name: str = "grid") -> str:
    """Grouped bars per benchmark for a few percentages (Avail, Gap, Recall)."""
    colors = [BLUE, VERMILION, GREEN, ORANGE, SKY, PURPLE]
    with matplotlib.rc_context(RC):
        fig, ax = _figure(max(7.0, 0.9 * len(benches) + 2), 3.2)
        x = np.arange(len(benches))
        width = 0.8 / max(1, len(series))
        ax.set_xlim(-0.5 - max(0, 2 - len(benches)), len(benches) - 0.5 + max(0, 2 - len(benches)))
        for k, (label, vals) in enumerate(series.items()):
            ax.bar(x - 0.4 + width * (k + 0.5), [np.nan if v is None else v for v in vals], width=width,
                   color=colors[k % len(colors)], label=label)
        ax.set_xticks(x, benches, rotation=30 if len(benches) > 5 else 0, ha="right" if len(benches) > 5 else "center")
        ax.set_ylim(0, 100)
        ax.set_ylabel("%")
        ax.legend(frameon=False, ncols=len(series))
        return to_svg(fig, name, "Avail, Gap and Recall per benchmark")


def tau_chart(arms: list[str], tau: list[float | None], lows: list[float | None], highs: list[float | None],
              live: list[float | None] | None = None, name: str = "replay-tau") -> str:
    """Replay tau per arm with its 95% interval as a whisker; the live decoder's tau as a marker, if given."""
    with matplotlib.rc_context(RC):
        fig, ax = _figure(7.0, 0.45 * len(arms) + 1.1)
        y = np.arange(len(arms))
        vals = np.array([np.nan if v is None else v for v in tau], dtype=float)
        lo = np.array([v if v is not None else np.nan for v in lows], dtype=float)
        hi = np.array([v if v is not None else np.nan for v in highs], dtype=float)
        err = np.vstack([np.nan_to_num(vals - lo), np.nan_to_num(hi - vals)]).clip(0, None)
        ax.barh(y, vals, xerr=err, color=BLUE, height=0.6, capsize=3, label="replay tau, 95% interval")
        for yi, v, h in zip(y, vals, hi):
            if not np.isnan(v):
                ax.annotate(f"{v:.2f}", (v if np.isnan(h) else h, yi), xytext=(4, 0), textcoords="offset points",
                            va="center", fontsize=8)
        top = [x for x in (*vals, *hi) if not np.isnan(x)]
        if live is not None:
            lv = np.array([np.nan if v is None else v for v in live], dtype=float)
            if not np.all(np.isnan(lv)):
                ax.plot(lv, y, "D", color=VERMILION, label="live tau (measured)")
                top += [x for x in lv if not np.isnan(x)]
        ax.set_yticks(y, arms)
        ax.invert_yaxis()
        ax.set_xlim(0, max(top) * 1.2 if top and max(top) > 0 else 1)
        ax.set_xlabel("tau (tokens per verification pass)")
        ax.legend(frameon=False, loc="lower right")
        return to_svg(fig, name, "tau per arm, replay with 95% intervals")


def index_chart(specs: list[str], bytes_per_state: list[float], recall: list[float], exact_recall: float | None,
                target_bytes: float = 128.0, name: str = "sweep-index") -> str:
    """Semantic gap recall (%) against bytes per state (log x), one labelled point per index spec; a line at 95%
    of exact's recall and one at the bytes-per-state target. A point inside both is drawn green."""
    ninety_five = 0.95 * exact_recall if exact_recall is not None else None
    with matplotlib.rc_context(RC):
        fig, ax = _figure(7.0, 3.6)
        x = np.asarray(bytes_per_state, dtype=float)
        y = np.asarray(recall, dtype=float)
        good = (x <= target_bytes) & (y >= ninety_five) if ninety_five is not None else np.zeros(len(x), bool)
        ax.scatter(x[~good], y[~good], color=BLUE, s=28, zorder=3)
        ax.scatter(x[good], y[good], color=GREEN, s=36, zorder=3, marker="D")
        for spec, xi, yi in zip(specs, x, y):
            ax.annotate(spec, (xi, yi), xytext=(4, 4), textcoords="offset points", fontsize=7.5)
        ax.set_xscale("log", base=2)
        # plain numbers at powers of two (text.parse_math is off, so the default 10^k labels would show raw TeX)
        ax.xaxis.set_major_locator(ticker.LogLocator(base=2))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.axvline(target_bytes, color=VERMILION, ls="--", lw=1, label=f"target: {target_bytes:g} B/state")
        if ninety_five is not None:
            ax.axhline(ninety_five, color=GREY, ls="--", lw=1, label=f"95% of exact's recall ({ninety_five:.1f}%)")
        lo, hi = min(x.min(), target_bytes), max(x.max(), target_bytes)
        ax.set_xlim(lo / 1.6, hi * 2.2)  # room for the labels right of the points
        top = max([*y, ninety_five or 0.0])
        ax.set_ylim(0, min(100.0, top * 1.15 + 1) if top > 0 else 1)
        ax.set_xlabel("bytes per state (log scale)")
        ax.set_ylabel("semantic gap recall, % of gap positions")
        ax.legend(frameon=False, loc="best")
        return to_svg(fig, name, "semantic gap recall against bytes per state")


def budget_chart(labels: list[str], tokens: list[float], series: dict[str, list[float | None]],
                 name: str = "sweep-budget") -> str:
    """Percentages against the pool's budget in tokens (log x), one line per series; `tokens` already places an
    unbounded pool (see render.budget_section) and `labels` name each point's tick ("10k", ..., "all")."""
    colors = {"availability": BLUE, "gap": VERMILION, "semantic gap recall": GREEN}
    with matplotlib.rc_context(RC):
        fig, ax = _figure(7.0, 3.4)
        x = np.asarray(tokens, dtype=float)
        for k, (label, vals) in enumerate(series.items()):
            v = np.array([np.nan if u is None else u for u in vals], dtype=float)
            ok = ~np.isnan(v)
            ax.plot(x[ok], v[ok], "o-", color=colors.get(label, [ORANGE, SKY, PURPLE][k % 3]), lw=1.8, ms=4,
                    label=label)
        ax.set_xscale("log")
        ax.set_xticks(x, labels)
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.set_xlim(x.min() / 1.5, x.max() * 1.5)
        ax.set_ylim(0, 100)
        ax.set_xlabel("pool budget, generated tokens (log scale)")
        ax.set_ylabel("%")
        ax.legend(frameon=False, ncols=len(series), loc="upper center", bbox_to_anchor=(0.5, -0.2))
        return to_svg(fig, name, "what the pool's size buys: availability, gap and semantic gap recall by budget")


def ablation_chart(arms: list[str], tau: list[float | None], lows: list[float | None], highs: list[float | None],
                   groups: list[str], name: str = "ablations",
                   title: str = "tau per ablation arm and ladder rung, replay with 95% intervals") -> str:
    """tau per arm as a point with its 95% interval as a whisker, top to bottom in the given order; the colour
    says the arm's group ("merged", "baseline", "ablation", "ladder")."""
    colors = {"merged": VERMILION, "baseline": PURPLE, "ablation": BLUE, "ladder": GREEN}
    with matplotlib.rc_context(RC):
        fig, ax = _figure(7.0, 0.32 * len(arms) + 1.1)
        y = np.arange(len(arms))
        vals = np.array([np.nan if v is None else v for v in tau], dtype=float)
        lo = np.array([np.nan if v is None else v for v in lows], dtype=float)
        hi = np.array([np.nan if v is None else v for v in highs], dtype=float)
        for group, color in colors.items():
            m = np.array([g == group for g in groups], dtype=bool) & ~np.isnan(vals)
            if not m.any():
                continue
            err = np.vstack([np.nan_to_num(vals[m] - lo[m]), np.nan_to_num(hi[m] - vals[m])]).clip(0, None)
            ax.errorbar(vals[m], y[m], xerr=err, fmt="o", color=color, capsize=3, ms=5, label=group)
        for yi, v, h in zip(y, vals, hi):
            if not np.isnan(v):
                ax.annotate(f"{v:.2f}", (v if np.isnan(h) else h, yi), xytext=(4, 0), textcoords="offset points",
                            va="center", fontsize=8)
        top = [x for x in (*vals, *hi) if not np.isnan(x)]
        ax.set_yticks(y, arms)
        ax.set_ylim(len(arms) - 0.5, -0.5)
        ax.set_xlim(0, max(top) * 1.2 if top and max(top) > 0 else 1)
        ax.set_xlabel("tau (tokens per verification pass), 95% interval")
        ax.legend(frameon=False, loc="lower right")
        return to_svg(fig, name, title)


def batch_chart(batches: list[int], series: dict[str, list[float | None]], name: str = "batch") -> str:
    """Speedup over vLLM greedy against the batch size (log2 x, a tick at each batch size), one line per arm
    (`series[arm][i]` at `batches[i]`, None where not known); dashed: 1.0, parity with greedy."""
    palette = [BLUE, ORANGE, GREEN, VERMILION, SKY, PURPLE, GREY, "#000000"]
    with matplotlib.rc_context(RC):
        fig, ax = _figure(7.0, 3.4)
        x = np.asarray(batches, dtype=float)
        top = 1.0
        for k, (label, vals) in enumerate(series.items()):
            v = np.array([np.nan if u is None else u for u in vals], dtype=float)
            ok = ~np.isnan(v)
            if ok.any():
                top = max(top, float(v[ok].max()))
            ax.plot(x[ok], v[ok], "o-", color=palette[k % len(palette)], lw=1.8, ms=4, label=label)
        ax.axhline(1.0, color=GREY, ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(int(b)) for b in batches])
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.set_xlim(x.min() / 1.5, x.max() * 1.5)
        ax.set_ylim(0, top * 1.15)
        ax.set_xlabel("batch size (log scale)")
        ax.set_ylabel("tok/s over vLLM greedy at the same batch")
        if series:
            ax.legend(frameon=False, ncols=min(3, len(series)), loc="upper center", bbox_to_anchor=(0.5, -0.2))
        return to_svg(fig, name, "speedup over vLLM greedy per arm against the batch size")

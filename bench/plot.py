"""Draws the gateway comparison: added time to first token against concurrent callers.

    "$(bash scripts/bench-venv.sh)/bin/python" bench/plot.py IN.json OUT.png

IN.json:
    {"title": "...",
     "provider_ttft_ms": {"1": 50.3, "64": 51.0},
     "targets": [{"name": "sluice serve",
                  "levels": [{"concurrency": 1, "added_p50_ms": 0.4, "added_p99_ms": 1.1,
                              "rps": 19.8}, ...]}, ...]}

One colour per target: p50 solid with markers, p99 dashed. Both axes are logarithmic (x base
2); an added time of 0 ms or less cannot be drawn on a log axis, so it is drawn at 0.01 ms
with a downward triangle. The provider's own time to first token, where given, is a grey
dotted line for scale. rps is not drawn. The PNG carries no timestamp or version, so the same
input gives the same bytes (with the same matplotlib, bench-venv's pin).
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402

FLOOR_MS = 0.01


def load(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    targets = data.get("targets")
    if not isinstance(targets, list) or not targets:
        sys.exit(f"{path}: no targets")
    for t in targets:
        if "name" not in t or not isinstance(t.get("levels"), list):
            sys.exit(f"{path}: every target needs a name and levels")
        for lv in t["levels"]:
            if "concurrency" not in lv:
                sys.exit(f"{path}: a level of {t['name']!r} has no concurrency")
    return data


def series(levels, key):
    """(concurrency, value, clamped) for each level that has KEY, by concurrency."""
    out = []
    for lv in sorted(levels, key=lambda lv: lv["concurrency"]):
        v = lv.get(key)
        if v is None:
            continue
        v = float(v)
        out.append((lv["concurrency"], max(v, FLOOR_MS), v <= 0))
    return out


def ms(v, _pos=None):
    return f"{v:g}"


def plot(data, out):
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    xs = set()
    any_clamped = False
    for i, t in enumerate(data["targets"]):
        colour = colours[i % len(colours)]
        for key, style, marker, label in (
            ("added_p50_ms", "-", "o", "p50"),
            ("added_p99_ms", "--", None, "p99"),
        ):
            s = series(t["levels"], key)
            if not s:
                continue
            x = [c for c, _, _ in s]
            y = [v for _, v, _ in s]
            xs.update(x)
            ax.plot(x, y, linestyle=style, marker=marker, markersize=5, color=colour,
                    linewidth=1.8 if style == "-" else 1.3, label=f"{t['name']} {label}")
            low = [(c, v) for c, v, clamped in s if clamped]
            if low:
                any_clamped = True
                ax.scatter([c for c, _ in low], [v for _, v in low], marker="v", s=60,
                           facecolors="white", edgecolors=colour, linewidths=1.5, zorder=3)
    provider = data.get("provider_ttft_ms") or {}
    if provider:
        p = sorted((int(c), float(v)) for c, v in provider.items())
        xs.update(c for c, _ in p)
        ax.plot([c for c, _ in p], [max(v, FLOOR_MS) for _, v in p], linestyle=":",
                color="0.55", linewidth=1.2, label="provider's own TTFT (for scale)")

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted(xs)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(ms))
    ax.yaxis.set_major_formatter(FuncFormatter(ms))
    if ticks:
        ax.set_xlim(ticks[0] / 1.3, ticks[-1] * 1.3)
    ax.set_xlabel("concurrent callers")
    ax.set_ylabel("added time to first token (ms, log)")
    ax.set_title(data.get("title", ""))
    ax.grid(True, which="major", linestyle="-", alpha=0.35)
    ax.grid(True, which="minor", axis="y", linestyle=":", alpha=0.2)

    handles, labels = ax.get_legend_handles_labels()
    if any_clamped:
        handles.append(Line2D([], [], linestyle="none", marker="v", markersize=8,
                              markerfacecolor="white", markeredgecolor="0.2"))
        labels.append(f"added ≤ 0 ms, drawn at {FLOOR_MS:g}")
    ax.legend(handles, labels, fontsize=8, loc="best", framealpha=0.9)
    fig.tight_layout()
    # No "Software" (matplotlib's version) and no creation time: the same input, the same bytes.
    fig.savefig(out, format="png", metadata={"Software": None})
    plt.close(fig)


def main(argv):
    if len(argv) != 3:
        sys.exit(f"usage: {argv[0]} IN.json OUT.png")
    plot(load(argv[1]), argv[2])


if __name__ == "__main__":
    main(sys.argv)

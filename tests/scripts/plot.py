#!/usr/bin/env python3
"""Line charts of benchmark samples (CSV files with a header), as PNG: drawn as SVG here and
rendered by headless Chromium (Debian's `chromium`), so nothing beyond the standard library and
the browser the project's tests use is needed.

    python3 tests/scripts/plot.py --out chart.png --title "Lag" --ylabel "ms" \
        "p99=run.csv:lat_p99_ms" "p50=run.csv:lat_p50_ms"

Each series is LABEL=FILE:EXPRESSION, the expression over the row's columns (numbers), e.g.
`(outbox_bytes+processed_bytes)/1048576`. The x axis is `t_s`, in minutes.
"""

import argparse
import csv
import html
import math
import os
import subprocess
import sys
import tempfile

WIDTH, HEIGHT = 960, 440
LEFT, RIGHT, TOP, BOTTOM = 80, 24, 48, 56
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]


def series_points(spec):
    label, _, rest = spec.partition("=")
    path, _, expression = rest.rpartition(":")
    if not (label and path and expression):
        sys.exit(f"plot.py: a series is LABEL=FILE:EXPRESSION, not {spec!r}")
    code = compile(expression, spec, "eval")
    points = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            values = {}
            for k, v in row.items():
                try:
                    values[k] = float(v)
                except (TypeError, ValueError):
                    pass
            points.append((values["t_s"] / 60.0, eval(code, {"__builtins__": {}}, values)))
    return label, points


def nice_ticks(high, count=6):
    if high <= 0:
        return [0, 1], 1
    raw = high / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    top = step * math.ceil(high / step)
    ticks = [i * step for i in range(int(round(top / step)) + 1)]
    return ticks, top


def fmt(v):
    return f"{v:g}" if abs(v) < 1e6 else f"{v:.3g}"


def svg(title, ylabel, series):
    xs = [x for _, pts in series for x, _ in pts]
    ys = [y for _, pts in series for _, y in pts]
    xticks, xtop = nice_ticks(max(xs) if xs else 1, 10)
    yticks, ytop = nice_ticks(max(ys) if ys else 1)
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x):
        return LEFT + pw * x / xtop

    def py(y):
        return TOP + ph - ph * y / ytop

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'font-family="DejaVu Sans, sans-serif" font-size="13">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="26" text-anchor="middle" font-size="16">'
        f"{html.escape(title)}</text>",
    ]
    for t in yticks:
        y = py(t)
        out.append(f'<line x1="{LEFT}" y1="{y}" x2="{WIDTH - RIGHT}" y2="{y}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4}" text-anchor="end">{fmt(t)}</text>')
    for t in xticks:
        x = px(t)
        out.append(f'<line x1="{x}" y1="{TOP}" x2="{x}" y2="{TOP + ph}" stroke="#f0f0f0"/>')
        out.append(f'<text x="{x}" y="{TOP + ph + 18}" text-anchor="middle">{fmt(t)}</text>')
    out.append(
        f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>'
    )
    out.append(
        f'<text x="{LEFT + pw / 2}" y="{HEIGHT - 14}" text-anchor="middle">minutes</text>'
    )
    out.append(
        f'<text transform="translate(18 {TOP + ph / 2}) rotate(-90)" text-anchor="middle">'
        f"{html.escape(ylabel)}</text>"
    )
    for i, (label, pts) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(
            f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.6"/>'
        )
        ly = TOP + 16 + 18 * i
        out.append(
            f'<line x1="{LEFT + 12}" y1="{ly - 4}" x2="{LEFT + 36}" y2="{ly - 4}" '
            f'stroke="{colour}" stroke-width="3"/>'
        )
        out.append(f'<text x="{LEFT + 42}" y="{ly}">{html.escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def render(svg_text, png):
    with tempfile.TemporaryDirectory() as d:
        page = os.path.join(d, "chart.svg")
        with open(page, "w") as f:
            f.write(svg_text)
        subprocess.run(
            [
                "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                f"--user-data-dir={os.path.join(d, 'profile')}",
                f"--window-size={WIDTH},{HEIGHT}",
                f"--screenshot={os.path.abspath(png)}", f"file://{page}",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--title", default="")
    parser.add_argument("--ylabel", default="")
    parser.add_argument("series", nargs="+", help="LABEL=FILE:EXPRESSION")
    args = parser.parse_args()
    render(svg(args.title, args.ylabel, [series_points(s) for s in args.series]), args.out)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""scripts/plot.py: PNG charts from the CSV tables the example programs write (--csv FILE).

    /usr/bin/python3 scripts/plot.py RUN.csv [MORE.csv ...] [-o DIR]

Each CSV is recognised by its columns:
  train_gpt --csv     loss curve (loss against tokens trained; several runs overlaid), strategy map (step against
                      layer and sublayer, coloured by strategy), predicted against measured memory and time per step
  plan_trace --csv    predicted step time per strategy against length, each strategy's memory limit (the longest
                      length that fits the budget) marked, the planners drawn over them
  moe_budget --csv    held-out perplexity and greedy agreement with the full budget against the activation budget,
                      one line per method (uniform top-k, Alloc-L, Alloc-L + Alloc-T)
  moe_simulate, moe_infer --switch-csv   where the dynamic policy switched: each step's batch size (tokens)
                      against the run's time (simulated, or the wall clock's), coloured by the layout it ran in (TP
                      or EP), one panel per trace
Charts are written to DIR (default: the folder of the first CSV) as <csv name>_<chart>.png, and listed.
Needs matplotlib (Debian: python3-matplotlib, installed by scripts/setup.sh).
"""
import argparse
import csv
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

TRAIN_COLUMNS = {"step", "plan", "loss", "seconds", "peak_mib", "predicted_mib"}
TRACE_COLUMNS = {"length", "variant", "kind", "time_s", "peak_bytes", "budget_bytes"}
BUDGET_COLUMNS = {"budget_percent", "method", "perplexity", "agreement"}
SWITCH_COLUMNS = {"trace", "policy", "step", "time_s", "tokens", "layout"}
# One colour per strategy, the same in every chart.
STRATEGY_COLOURS = {
    "MegatronTS": "#4e79a7",
    "UlyssesZ": "#f28e2b",
    "MegatronCZ": "#59a14f",
    "METP": "#e15759",
    "ColossalZ": "#b07aa1",
}


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def colour_of(name, index):
    return STRATEGY_COLOURS.get(name, plt.get_cmap("tab10")(index % 10))


def save(fig, out_dir, stem, chart):
    path = os.path.join(out_dir, f"{stem}_{chart}.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(path)
    return path


def plot_loss(runs, out_dir):
    """Loss against tokens trained, every train_gpt CSV given overlaid."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in runs:
        tokens, losses, total = [], [], 0
        for r in rows:
            if r.get("status", "ok") != "ok":
                continue
            total += int(number(r.get("tokens", r["length"])))
            tokens.append(total)
            losses.append(number(r["loss"]))
        ax.plot(tokens, losses, marker=".", label=name)
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title("train_gpt: loss curve")
    ax.grid(alpha=0.3)
    ax.legend()
    return save(fig, out_dir, runs[0][0], "loss")


def plot_strategy_map(name, rows, out_dir):
    """Step (x) against layer and sublayer (y), each cell coloured by the strategy the plan chose."""
    planned = [r for r in rows if r["plan"]]
    if not planned:
        return None
    strategies = sorted({s for r in planned for layer in r["plan"].split() for s in layer.split("/")},
                        key=lambda s: list(STRATEGY_COLOURS).index(s) if s in STRATEGY_COLOURS else 99)
    index = {s: i for i, s in enumerate(strategies)}
    layers = len(planned[0]["plan"].split())
    grid = [[math.nan] * len(planned) for _ in range(2 * layers)]
    for x, r in enumerate(planned):
        for l, layer in enumerate(r["plan"].split()):
            attention, mlp = layer.split("/")
            grid[2 * l][x] = index[attention]
            grid[2 * l + 1][x] = index[mlp]
    fig, ax = plt.subplots(figsize=(max(6, 0.25 * len(planned) + 2), 0.35 * 2 * layers + 1.8))
    cmap = ListedColormap([colour_of(s, i) for i, s in enumerate(strategies)])
    ax.imshow(grid, aspect="auto", cmap=cmap, vmin=-0.5, vmax=len(strategies) - 0.5, interpolation="nearest")
    ax.set_yticks(range(2 * layers))
    ax.set_yticklabels([f"L{l} {part}" for l in range(layers) for part in ("attn", "mlp")])
    ax.set_xticks(range(len(planned)))
    ax.set_xticklabels([f"{r['step']}\n{r['length']}" for r in planned], fontsize=6)
    ax.set_xlabel("step (and its length)")
    ax.set_title(f"{name}: strategy per layer and sublayer")
    ax.legend(handles=[Patch(color=colour_of(s, i), label=s) for i, s in enumerate(strategies)],
              bbox_to_anchor=(1.01, 1), loc="upper left", fontsize=8)
    return save(fig, out_dir, name, "strategy_map")


def plot_predicted_vs_measured(name, rows, out_dir):
    """Per step: measured peak memory against the memory model's, and measured time against the time model's."""
    ok = [r for r in rows if r.get("status", "ok") == "ok"]
    if not ok:
        return None
    has_time = "predicted_s" in ok[0]
    fig, axes = plt.subplots(1, 2 if has_time else 1, figsize=(11 if has_time else 6, 4))
    axes = list(axes) if has_time else [axes]
    lengths = [number(r["length"]) for r in ok]
    ax = axes[0]
    ax.scatter(lengths, [number(r["predicted_mib"]) for r in ok], marker="x", label="predicted (memory model)")
    ax.scatter(lengths, [number(r["peak_mib"]) for r in ok], marker="o", facecolors="none", edgecolors="C1",
               label="measured (trackers)")
    cap = number(ok[0]["cap_mib"])
    if not math.isnan(cap):
        ax.axhline(cap, color="red", linestyle="--", label=f"cap {cap:.0f} MiB")
    ax.set_xlabel("step length (tokens)")
    ax.set_ylabel("peak memory per rank (MiB)")
    ax.set_title("memory per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if has_time:
        ax = axes[1]
        ax.scatter(lengths, [number(r["predicted_s"]) for r in ok], marker="x", label="predicted (layer stack)")
        ax.scatter(lengths, [number(r["seconds"]) for r in ok], marker="o", facecolors="none", edgecolors="C1",
                   label="measured (whole step)")
        ax.set_xlabel("step length (tokens)")
        ax.set_ylabel("seconds")
        ax.set_title("time per step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{name}: predicted against measured")
    return save(fig, out_dir, name, "predicted_vs_measured")


def plot_trace(name, rows, out_dir):
    """plan_trace: predicted step time against length per strategy and planner, per dataset; each static
    strategy's memory limit (the longest length that fits) as a dotted line of its colour."""
    datasets = sorted({r["dataset"] for r in rows})
    fig, axes = plt.subplots(1, len(datasets), figsize=(7 * len(datasets), 4.5), squeeze=False)
    shown = ["exact planner", "ParaDySe heuristic"]
    for ax, dataset in zip(axes[0], datasets):
        mine = [r for r in rows if r["dataset"] == dataset]
        variants = []
        for r in mine:
            if r["variant"] not in variants and (r["kind"] == "static" or r["variant"] in shown):
                variants.append(r["variant"])
        for i, variant in enumerate(variants):
            points = sorted((number(r["length"]), number(r["time_s"])) for r in mine if r["variant"] == variant)
            fits = [(l, t) for l, t in points if not math.isnan(t)]
            static = variant in STRATEGY_COLOURS or any(r["kind"] == "static" for r in mine if r["variant"] == variant)
            colour = colour_of(variant, i) if static else ("black" if variant == "exact planner" else "grey")
            if fits:
                ax.plot([l for l, _ in fits], [t for _, t in fits], label=variant, color=colour,
                        linewidth=1.0 if static else 1.8, linestyle="-" if static else "--")
            if static:
                limit = max((l for l, _ in fits), default=0)
                longest = max(l for l, _ in points)
                if 0 < limit < longest:
                    ax.axvline(limit, color=colour, linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("predicted step time (s)")
        budget = number(mine[0]["budget_bytes"]) / 2**30
        ax.set_title(f"{dataset}: time per strategy (dotted: memory limit at {budget:.0f} GiB)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return save(fig, out_dir, name, "time_per_strategy")


def plot_budget(name, rows, out_dir):
    """moe_budget: quality against the activation budget, one line per method; with the timing columns, a third
    panel: prefill (solid) and decode (dashed) speed-up over the full budget."""
    timed = {"prefill_speedup", "decode_speedup"} <= set(rows[0].keys())
    fig, axes = plt.subplots(1, 3 if timed else 2, figsize=(18 if timed else 12, 4.5))
    methods = []
    for r in rows:
        if r["method"] not in methods:
            methods.append(r["method"])
    for i, method in enumerate(methods):
        points = sorted((number(r["budget_percent"]), number(r["perplexity"]), 100 * number(r["agreement"]))
                        for r in rows if r["method"] == method)
        for ax, column in zip(axes, (1, 2)):
            ax.plot([p[0] for p in points], [p[column] for p in points], marker="o", label=method,
                    color=colour_of(method, i))
        if timed:
            speed = sorted((number(r["budget_percent"]), number(r["prefill_speedup"]), number(r["decode_speedup"]))
                           for r in rows if r["method"] == method)
            for column, style, kind in ((1, "-", "prefill"), (2, "--", "decode")):
                axes[2].plot([p[0] for p in speed], [p[column] for p in speed], linestyle=style, marker="o",
                             label=f"{method}, {kind}", color=colour_of(method, i))
    labels = ["held-out perplexity", "greedy agreement with the full budget (%)"]
    if timed:
        labels.append("time per token: full budget / this budget")
    for ax, label in zip(axes, labels):
        ax.set_xlabel("activation budget (% of sum of top-k)")
        ax.set_ylabel(label)
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{name}: quality against the activation budget")
    return save(fig, out_dir, name, "quality_vs_budget")


def plot_switches(name, rows, out_dir):
    """moe_simulate or moe_infer --switch-csv: batch size against time, one dot per step coloured by its layout, one
    panel per trace (the dynamic policy's rows; the first policy's when there is no dynamic one)."""
    traces = []
    for r in rows:
        if r["trace"] not in traces:
            traces.append(r["trace"])
    fig, axes = plt.subplots(len(traces), 1, figsize=(12, 3.2 * len(traces)), squeeze=False)
    for ax, trace in zip(axes[:, 0], traces):
        mine = [r for r in rows if r["trace"] == trace]
        policies = sorted({r["policy"] for r in mine})
        policy = next((p for p in policies if "dynamic" in p), policies[0])
        mine = [r for r in mine if r["policy"] == policy]
        for layout, colour in (("TP", "#4e79a7"), ("EP", "#e15759")):
            points = [(number(r["time_s"]), number(r["tokens"])) for r in mine if r["layout"] == layout]
            ax.scatter([p[0] for p in points], [p[1] for p in points], s=4, color=colour, label=layout)
        ax.set_xlabel("time on the run's clock (s)")
        ax.set_ylabel("tokens in the step")
        ax.set_title(f"{trace}: {policy}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, markerscale=3)
    fig.suptitle(f"{name}: batch size and layout over time")
    return save(fig, out_dir, name, "switches")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("csv", nargs="+", help="CSV files written by --csv")
    parser.add_argument("-o", "--out", help="folder for the PNGs (default: the first CSV's folder)")
    args = parser.parse_args()
    out_dir = args.out or os.path.dirname(os.path.abspath(args.csv[0]))
    os.makedirs(out_dir, exist_ok=True)
    runs = []
    for path in args.csv:
        try:
            rows = read_csv(path)
        except OSError as e:
            sys.exit(f"plot.py: cannot read {path}: {e.strerror}")
        if not rows:
            sys.exit(f"plot.py: {path} has no rows")
        name = os.path.splitext(os.path.basename(path))[0]
        columns = set(rows[0].keys())
        if TRAIN_COLUMNS <= columns:
            runs.append((name, rows))
            plot_strategy_map(name, rows, out_dir)
            plot_predicted_vs_measured(name, rows, out_dir)
        elif TRACE_COLUMNS <= columns:
            plot_trace(name, rows, out_dir)
        elif BUDGET_COLUMNS <= columns:
            plot_budget(name, rows, out_dir)
        elif SWITCH_COLUMNS <= columns:
            plot_switches(name, rows, out_dir)
        else:
            sys.exit(f"plot.py: {path}: not a train_gpt, plan_trace, moe_budget or switch log (moe_simulate, "
                     f"moe_infer) CSV (columns: {', '.join(sorted(columns))})")
    if runs:
        plot_loss(runs, out_dir)


if __name__ == "__main__":
    main()

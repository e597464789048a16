"""A self-contained HTML report of a job's output directory, plus benchmark JSON files.

One page, no external files: plots are PNGs rendered with matplotlib's Agg canvas and embedded as
`data:image/png;base64` URIs. Sections (only rows with status ok/truncated are plotted):

1. verifier calls per sentence, and calls saved against greedy, vs edit ratio (the IAD paper's
   Figure 5). Greedy makes hyp_len + 1 calls (one per token incl. eos), so calls saved =
   (hyp_len + 1) / iterations. Edit ratio = token edit distance between src and hyp (difflib
   opcodes over whitespace tokens) / src tokens.
2. distribution of draft tokens accepted per verifier call (`accepted_per_iter`);
3. throughput by source length bucket (src_len, model tokens) from each row's decode_ms share;
4. acceptance by position in the draft block (see `acceptance_by_position`);
5. time against a greedy run of the same inputs (`compare`): decoder time of the rows both hold, by id,
   and the share of identical outputs;
6. a method comparison table and plot from `python -m bench compare` results files (`runs` lists), when given.

The summary says what drafting did: the share of verifier calls that carried a draft where a draft
budget chose (`draft_length = "auto"`), and why it chose so (the manifest's totals).

Needs matplotlib (the `report` extra).
"""

from __future__ import annotations

import base64
import difflib
import html
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aggdec.extras import install_hint
from aggdec.schema import (
    DECODED_STATUSES,
    STATS_COLUMNS,
    count_status,
    read_manifest,
    read_outputs,
)

REPORT_COLUMNS = ("src", "hyp", "status", "method", *STATS_COLUMNS)
BENCH_KEYS = ("method", "batch_size", "sentences_per_s")
LENGTH_EDGES = (0, 10, 20, 30, 40, 60, 80, 120)  # src_len buckets (lo, hi]; the last is open
EDIT_RATIO_EDGES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)  # binned medians: exactly 0, (lo, hi], > 0.5
MAX_SCATTER_POINTS = 20_000
MAX_POSITION = 32
MAX_HIST_BIN = 40
FIG_WIDTH, FIG_HEIGHT, FIG_DPI = 11.0, 4.0, 100


# -- per-sentence and per-call statistics ---------------------------------------------------------

def edit_ratio(src: str, hyp: str) -> float:
    """Token edit distance between `src` and `hyp` (whitespace tokens) / number of src tokens.

    The distance is the size of difflib's non-equal opcodes, max(deleted, inserted) per opcode
    (a replacement counts once per replaced position). An empty src gives 0.0 for an empty hyp, else len(hyp).
    """
    a, b = src.split(), hyp.split()
    ops = difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()
    distance = sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")
    return distance / len(a) if a else float(distance)


def acceptance_by_position(accepted_per_iter: Sequence[Sequence[int]], max_position: int = MAX_POSITION) -> dict:
    """How often the p-th draft token of a verifier call is accepted, p = 1..max_position.

    A call that accepted a tokens accepted positions 1..a (acceptance stops at the first mismatch).
    survival[p-1] = share of calls with a >= p; conditional[p-1] = P(p accepted | p-1 accepted)
    = survival[p-1] / survival[p-2] (None where no call reached p-1). Outputs do not record how many
    tokens each call drafted, so survival is P(accepted at p) counting calls that drafted fewer than
    p tokens as rejections: a lower bound on acceptance given that position p was drafted.
    """
    counts = np.asarray([a for row in accepted_per_iter for a in row], dtype=np.int64)
    calls = len(counts)
    reached = np.bincount(np.minimum(counts, max_position), minlength=max_position + 1)[::-1].cumsum()[::-1]
    survival = [float(reached[p] / calls) if calls else 0.0 for p in range(1, max_position + 1)]
    conditional = [float(reached[p] / reached[p - 1]) if reached[p - 1] else None for p in range(1, max_position + 1)]
    return {"calls": calls, "positions": list(range(1, max_position + 1)), "survival": survival,
            "conditional": conditional}


def length_buckets(src_len: np.ndarray, hyp_len: np.ndarray, decode_ms: np.ndarray,
                   edges: Sequence[int] = LENGTH_EDGES) -> list[dict[str, Any]]:
    """Throughput per src_len bucket (lo, hi]: sentences, output tokens (hyp_len + 1), decoder seconds
    (the rows' summed decode_ms shares), sentences/s and tokens/s. Empty buckets are left out."""
    out = []
    bounds = [*edges, None]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        mask = (src_len > lo) & (src_len <= hi if hi is not None else True)
        n = int(mask.sum())
        if not n:
            continue
        seconds = float(decode_ms[mask].sum()) / 1000.0
        tokens = int((hyp_len[mask] + 1).sum())
        out.append({"bucket": _bucket_label(lo, hi), "sentences": n, "tokens": tokens,
                    "seconds": seconds, "sentences_per_s": n / seconds if seconds else None,
                    "tokens_per_s": tokens / seconds if seconds else None})
    return out


def _bucket_label(lo: int, hi: int | None) -> str:
    return f"{lo + 1}-{hi}" if hi is not None else f">{lo}"


def bucket_labels(edges: Sequence[int] = LENGTH_EDGES) -> list[str]:
    """Labels of length_buckets' buckets, shortest first."""
    bounds = [*edges, None]
    return [_bucket_label(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def load_bench(path: str | Path) -> list[dict[str, Any]]:
    """The measured `runs` of a benchmark results file (runs that failed, with an `error`, left out);
    ValueError naming the file and key when malformed."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    runs = data.get("runs") if isinstance(data, dict) else None
    if isinstance(runs, list):
        runs = [r for r in runs if not (isinstance(r, dict) and "error" in r)]
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"{path}: no measured 'runs' (expected a `python -m bench` results file)")
    for i, run in enumerate(runs):
        for key in BENCH_KEYS:
            if not isinstance(run, dict) or key not in run:
                raise ValueError(f"{path}: runs[{i}] has no {key!r}")
    return runs


# -- figures --------------------------------------------------------------------------------------

def _figure(ncols: int = 1) -> tuple[Any, list[Any]]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"the HTML report needs matplotlib: {install_hint('report')}") from e
    fig = Figure(figsize=(FIG_WIDTH, FIG_HEIGHT), dpi=FIG_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, list(axes)


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _color(methods: list[str], method: str) -> str:
    return f"C{methods.index(method) % 10}"


def _binned_medians(x: np.ndarray, y: np.ndarray) -> tuple[list[float], list[float]]:
    """(median x, median y) per edit-ratio bin: exactly 0, (e_k, e_k+1] for EDIT_RATIO_EDGES, > the last edge."""
    edges = EDIT_RATIO_EDGES
    masks = [x == 0, *[(x > lo) & (x <= hi) for lo, hi in zip(edges[:-1], edges[1:])], x > edges[-1]]
    kept = [m for m in masks if m.any()]
    return [float(np.median(x[m])) for m in kept], [float(np.median(y[m])) for m in kept]


def _fig_calls_vs_edit_ratio(rows: dict[str, np.ndarray], methods: list[str]) -> str:
    fig, (left, right) = _figure(2)
    from matplotlib.ticker import (  # after _figure: it names the extra if missing
        FormatStrFormatter,
        MaxNLocator,
    )

    rng = np.random.default_rng(0)
    for m in methods:
        idx = np.flatnonzero(rows["method"] == m)
        x, calls = rows["edit_ratio"][idx], rows["iterations"][idx]
        saved = (rows["hyp_len"][idx] + 1) / np.maximum(calls, 1)
        too_many = len(idx) > MAX_SCATTER_POINTS
        shown = rng.choice(len(idx), MAX_SCATTER_POINTS, replace=False) if too_many else slice(None)
        c = _color(methods, m)
        left.scatter(x[shown], calls[shown], s=8, alpha=0.35, color=c, label=m, linewidths=0)
        right.scatter(x[shown], saved[shown], s=8, alpha=0.25, color=c, linewidths=0)
        bx, by = _binned_medians(x, saved)
        right.plot(bx, by, "-o", color=c, lw=2, ms=7, mec="white", zorder=3, label=f"{m}: median per edit-ratio bin")
    left.yaxis.set_major_locator(MaxNLocator(integer=True))
    left.set(xlabel="edit ratio (token edits src -> hyp / src tokens)", ylabel="verifier calls per sentence",
             title="Verifier calls vs edit ratio")
    right.axhline(1.0, color="0.3", ls="--", lw=1, label="greedy (1 token per call)")
    right.set(xlabel="edit ratio", ylabel="calls saved: (hyp_len + 1) / calls",
              title="Calls saved vs greedy (not time)")
    if ((rows["hyp_len"] + 1) / np.maximum(rows["iterations"], 1)).max() >= 4:  # a log axis only for wide ranges
        right.set_yscale("log", base=2)
        right.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    for handle in left.legend(markerscale=2).legend_handles:
        handle.set_alpha(1.0)
    right.legend(loc="upper right", fontsize="small")
    return _png(fig)


def _fig_accepted_hist(rows: dict[str, np.ndarray], methods: list[str]) -> str:
    fig, (ax,) = _figure(1)
    per_method = {m: np.asarray([a for row in rows["accepted_per_iter"][rows["method"] == m] for a in row], np.int64)
                  for m in methods}
    top = min(MAX_HIST_BIN, max((int(v.max()) for v in per_method.values() if len(v)), default=0))
    width = 0.8 / len(methods)
    for k, m in enumerate(methods):
        v = per_method[m]
        counts = np.bincount(np.minimum(v, top), minlength=top + 1) / max(len(v), 1)
        ax.bar(np.arange(top + 1) + (k - (len(methods) - 1) / 2) * width, counts, width=width, color=_color(methods, m),
               label=f"{m} ({len(v)} calls, mean {v.mean() if len(v) else 0:.2f})")
    ax.set_xticks(range(0, top + 1, max(1, (top + 1) // 20)))
    overflow = f" (last bar: >= {top})" if top == MAX_HIST_BIN else ""
    ax.set(xlabel=f"draft tokens accepted in one verifier call{overflow}",
           ylabel="share of verifier calls", title="Accepted tokens per verifier call")
    ax.set_yscale("log")
    ax.legend()
    return _png(fig)


def _fig_throughput(buckets: dict[str, list[dict]], methods: list[str]) -> str:
    fig, (left, right) = _figure(2)
    present = {b["bucket"] for bs in buckets.values() for b in bs}
    labels = [lab for lab in bucket_labels() if lab in present]
    width = 0.8 / len(methods)
    for k, m in enumerate(methods):
        by = {b["bucket"]: b for b in buckets[m]}
        xs = np.arange(len(labels)) + (k - (len(methods) - 1) / 2) * width
        for ax, key in ((left, "sentences_per_s"), (right, "tokens_per_s")):
            vals = [(by[lab][key] or 0.0) if lab in by else 0.0 for lab in labels]
            bars = ax.bar(xs, vals, width=width, color=_color(methods, m), label=m)
            if key == "sentences_per_s":
                ax.bar_label(bars, labels=[f"n={by[lab]['sentences']}" if lab in by else "" for lab in labels],
                             fontsize="x-small", padding=2)
    for ax, what in ((left, "sentences / s"), (right, "output tokens / s")):
        ax.set_xticks(range(len(labels)), labels)
        ax.set(xlabel="source length (model tokens)", ylabel=f"{what} of decoder time", title=f"Throughput: {what}")
        ax.margins(y=0.12)
    left.legend()
    return _png(fig)


def _fig_position(positions: dict[str, dict], methods: list[str]) -> str:
    fig, (left, right) = _figure(2)
    from matplotlib.ticker import MaxNLocator

    for m in methods:
        pos = positions[m]
        c = _color(methods, m)
        left.plot(pos["positions"], pos["survival"], "-o", ms=3, color=c, label=f"{m} ({pos['calls']} calls)")
        cond = [(p, v) for p, v in zip(pos["positions"], pos["conditional"]) if v is not None]
        right.plot([p for p, _ in cond], [v for _, v in cond], "-o", ms=3, color=c, label=m)
    left.set(xlabel="position p in the draft block", ylabel="P(accepted at p)", ylim=(0, 1.02),
             title="Acceptance by position (calls drafting < p count as rejected)")
    right.set(xlabel="position p in the draft block", ylabel="P(accepted at p | accepted at p-1)", ylim=(0, 1.02),
              title="Conditional acceptance by position")
    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.legend()
    return _png(fig)


def _fig_bench(benches: list[tuple[str, list[dict]]]) -> str:
    fig, (ax,) = _figure(1)
    series: dict[str, list[tuple[int, float]]] = {}
    for name, runs in benches:
        for r in runs:
            label = r["method"] if len(benches) == 1 else f"{name}: {r['method']}"
            series.setdefault(label, []).append((int(r["batch_size"]), float(r["sentences_per_s"])))
    for k, (label, pts) in enumerate(sorted(series.items())):
        pts.sort()
        ax.plot([p for p, _ in pts], [v for _, v in pts], "-o", color=f"C{k % 10}", label=label)
    sizes = sorted({p for pts in series.values() for p, _ in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set(xlabel="batch size", ylabel="sentences / s", title="Benchmarks: throughput by batch size")
    ax.legend(fontsize="small")
    return _png(fig)


# -- HTML -----------------------------------------------------------------------------------------

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1120px;
       color: #222; line-height: 1.4; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: right; }
th { background: #f3f3f3; } td.l, th.l { text-align: left; }
code { background: #f5f5f5; padding: 0 0.2em; word-break: break-all; }
img { max-width: 100%; height: auto; display: block; margin: 0.5em 0; }
p.note { color: #555; font-size: 0.9em; }
"""


LEFT = ' class="l"'


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 1 else f"{v:,.2f}" if abs(v) < 100 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    """An HTML table; the first `left` columns are left-aligned text. Cells are escaped."""
    def cells(tag: str, values: Sequence[Any]) -> str:
        return "".join(f"<{tag}{LEFT if i < left else ''}>{html.escape(_fmt(v))}</{tag}>" for i, v in enumerate(values))
    body = "".join(f"<tr>{cells('td', r)}</tr>" for r in rows)
    return f"<table><tr>{cells('th', header)}</tr>{body}</table>"


def _img(png: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{png}">'


def _load_rows(out_dir: str | Path) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    table = read_outputs(out_dir, REPORT_COLUMNS)
    status = table.column("status").to_pylist()
    status_counts = count_status(str(s) for s in status)
    keep = np.isin(np.asarray(status, dtype=object), list(DECODED_STATUSES))
    if not keep.any():
        raise ValueError(f"{out_dir}: no rows with status ok/truncated to report on (status counts: {status_counts})")
    rows: dict[str, np.ndarray] = {}
    for name in ("src_len", "hyp_len", "iterations", "drafted", "accepted"):
        rows[name] = table.column(name).to_numpy(zero_copy_only=False).astype(np.int64)[keep]
    rows["decode_ms"] = table.column("decode_ms").to_numpy(zero_copy_only=False).astype(np.float64)[keep]
    for name, missing in (("method", ""), ("src", ""), ("hyp", ""), ("accepted_per_iter", [])):
        rows[name] = np.fromiter((missing if v is None else v for v in table.column(name).to_pylist()), dtype=object,
                                 count=table.num_rows)[keep]  # 1-D even when every list has the same length
    rows["edit_ratio"] = np.asarray([edit_ratio(s, h) for s, h in zip(rows["src"], rows["hyp"])], dtype=np.float64)
    return rows, status_counts


def _summary_section(out_dir: str | Path, manifest: dict | None, rows: dict[str, np.ndarray],
                     status_counts: dict[str, int], methods: list[str]) -> str:
    facts: list[tuple[str, Any]] = [("output", str(out_dir))]
    if manifest:
        facts += [("job complete", manifest.get("complete")), ("signature", manifest.get("signature")),
                  ("model", f"{manifest.get('model', {}).get('path')} (sha {manifest.get('model', {}).get('sha')})"),
                  ("aggdec version", manifest.get("aggdec_version"))]
        wall = _last_run_wall(manifest)
        if wall:
            facts.append(("last run", wall))
    facts.append(("rows by status", ", ".join(f"{k}: {v:,}" for k, v in sorted(status_counts.items()))))
    drafting = (manifest or {}).get("totals", {}).get("drafting", {})
    if drafting.get("calls"):
        facts.append(("drafting", f"{drafting['drafting_calls'] / drafting['calls']:.0%} of {drafting['calls']:,} "
                                  "verifier calls carried a draft (draft_length auto)"))
        facts += [("draft budget", why) for why in drafting.get("budget", [])]
    kv = "".join(f"<tr><th{LEFT}>{html.escape(k)}</th><td{LEFT}><code>{html.escape(_fmt(v))}</code></td></tr>"
                 for k, v in facts)
    per_method = []
    for m in methods:
        sel = rows["method"] == m
        calls, tokens = int(rows["iterations"][sel].sum()), int((rows["hyp_len"][sel] + 1).sum())
        drafted, accepted = int(rows["drafted"][sel].sum()), int(rows["accepted"][sel].sum())
        seconds = float(rows["decode_ms"][sel].sum()) / 1000.0
        per_method.append([m, int(sel.sum()), calls, tokens, tokens / calls if calls else None,
                           accepted / calls if calls else None, accepted / drafted if drafted else None,
                           float(np.median(rows["edit_ratio"][sel])), seconds,
                           int(sel.sum()) / seconds if seconds else None])
    header = ["method", "sentences", "verifier calls", "output tokens", "tokens / call (calls saved, not time)",
              "accepted / call", "accepted / drafted", "median edit ratio", "decoder time s",
              "sentences / s of decoder time"]
    return (f"<h2>Summary</h2><table>{kv}</table>{_table(header, per_method)}"
            "<p class=\"note\">Rows with status ok or truncated; output tokens include eos. Wall: the last run's "
            "wall-clock time decoding and committing (as in the summary of <code>aggdec run</code>). Decoder time: "
            "the sum of each row's share of verifier/drafter time, additive across shards, actors and runs, so it "
            "leaves out reading, writing and scheduling.</p>")


def _compare_section(out_dir: str | Path, greedy_dir: str | Path) -> str:
    """Time against greedy: the rows of `out_dir` and `greedy_dir` (a greedy run of the same inputs)
    that both decoded, matched by id; each side's decoder time for them, the ratio, and the share of
    identical outputs. ValueError where they share no id."""
    columns = ("id", "hyp", "status", "decode_ms")
    ours, theirs = (read_outputs(d, columns).to_pydict() for d in (out_dir, greedy_dir))
    mine = {i: (h, ms) for i, h, st, ms in zip(*(ours[c] for c in columns)) if st in DECODED_STATUSES}
    both = [(mine[i], (h, ms)) for i, h, st, ms in zip(*(theirs[c] for c in columns))
            if st in DECODED_STATUSES and i in mine]
    if not both:
        raise ValueError(f"{greedy_dir}: no decoded row shares an id with {out_dir}")
    seconds = sum(a[1] for a, _ in both) / 1000.0
    greedy_seconds = sum(b[1] for _, b in both) / 1000.0
    same = sum(a[0] == b[0] for a, b in both) / len(both)
    rows = [[str(out_dir), len(both), seconds, greedy_seconds / seconds if seconds else None, same],
            [str(greedy_dir), len(both), greedy_seconds, 1.0, 1.0]]
    return ("<h2>Time against greedy</h2>"
            + _table(["output", "rows in both", "decoder time s", "x greedy (time)", "identical to greedy"], rows)
            + "<p class=\"note\">Decoder time of the rows both outputs decoded (matched by id): the time that "
              "drafting saves or costs, unlike calls saved above. Both runs should have had the machine to "
              "themselves.</p>")


def _last_run_wall(manifest: dict) -> str | None:
    """"decoded N rows: wall X s, Y sentences/s" for the manifest's last run, None when it decoded nothing."""
    seconds = manifest.get("timings", {}).get("pipeline_s")
    shards = manifest.get("shards", {})
    rows = sum(shards.get(unit, {}).get("rows", 0) for unit in manifest.get("run", {}).get("committed", []))
    if not rows or not seconds:
        return None
    return f"decoded {rows:,} rows: wall {seconds:.1f} s, {rows / seconds:.1f} sentences/s"


def build_report(out_dir: str | Path, bench_paths: Sequence[str | Path] = (), compare: str | Path | None = None) -> str:
    """The report page for output directory `out_dir` (and benchmark JSON files; `compare`: the output
    of a greedy run of the same inputs, for time against greedy) as one HTML string.

    Raises ValueError naming the file/column at fault for unreadable inputs, and when no row has
    status ok/truncated; ImportError naming the `report` extra when matplotlib is missing.
    """
    rows, status_counts = _load_rows(out_dir)
    benches = [(Path(p).name, load_bench(p)) for p in bench_paths]
    manifest = read_manifest(out_dir) if Path(out_dir).is_dir() else None
    methods = sorted(set(rows["method"].tolist()))
    longest = max((max(a, default=0) for a in rows["accepted_per_iter"]), default=0)
    last = min(MAX_POSITION, longest + 1)
    positions = {m: acceptance_by_position(rows["accepted_per_iter"][rows["method"] == m], last) for m in methods}
    buckets = {m: length_buckets(rows["src_len"][sel], rows["hyp_len"][sel], rows["decode_ms"][sel])
               for m in methods for sel in [rows["method"] == m]}
    parts = [f"<h1>aggdec report</h1><p class=\"note\"><code>{html.escape(str(out_dir))}</code></p>",
             _summary_section(out_dir, manifest, rows, status_counts, methods),
             _compare_section(out_dir, compare) if compare else "",
             "<h2>Verifier calls vs edit ratio</h2>",
             _img(_fig_calls_vs_edit_ratio(rows, methods), "verifier calls and calls saved vs edit ratio"),
             "<p class=\"note\">Greedy decoding needs hyp_len + 1 verifier calls; aggressive decoding saves the most "
             "where the output stays close to the input (the IAD paper's Figure 5). Edit ratio: token edit distance "
             "between src and hyp (whitespace tokens) / src tokens.</p>",
             "<h2>Accepted tokens per verifier call</h2>",
             _img(_fig_accepted_hist(rows, methods), "histogram of accepted tokens per verifier call"),
             "<h2>Throughput by source length</h2>",
             _img(_fig_throughput(buckets, methods), "throughput by source length bucket"),
             _table(["method", "src_len", "sentences", "output tokens", "decoder time s",
                     "sentences / s of decoder time", "tokens / s of decoder time"],
                    [[m, b["bucket"], b["sentences"], b["tokens"], b["seconds"], b["sentences_per_s"],
                      b["tokens_per_s"]] for m in methods for b in buckets[m]], left=2),
             "<h2>Acceptance by position in the draft block</h2>",
             _img(_fig_position(positions, methods), "acceptance by position in the draft block"),
             "<p class=\"note\">A call that accepted a draft tokens accepted positions 1..a. Outputs do not record "
             "each call's draft length, so a call that drafted fewer than p tokens counts as a rejection at p: "
             "the left curve is a lower bound on P(accepted | drafted).</p>",
             "<h2>Method comparison (benchmarks)</h2>"]
    if benches:
        parts.append(_img(_fig_bench(benches), "benchmark throughput by batch size"))
        parts.append(_bench_table(benches))
    else:
        parts.append("<p class=\"note\">No benchmark files given (<code>--bench results.json</code>).</p>")
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>aggdec report</title>"
            f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>\n")


def _bench_table(benches: list[tuple[str, list[dict]]]) -> str:
    rows = []
    for name, runs in benches:
        greedy = {r["batch_size"]: r for r in runs if r["method"] == "greedy"}
        for r in sorted(runs, key=lambda r: (r["batch_size"], r["method"])):
            g = greedy.get(r["batch_size"])
            same_data = g is not None and g.get("sentences") == r.get("sentences")
            rows.append([name, r["method"], r["batch_size"], r["sentences_per_s"], r.get("tokens_per_s"),
                         r["sentences_per_s"] / g["sentences_per_s"] if same_data else None,
                         r.get("identical"), r.get("calls_per_sentence")])
    header = ["file", "method", "batch", "sentences / s", "tokens / s", "x greedy (same batch)",
              "identical to the reference", "calls / sentence"]
    return _table(header, rows, left=2)

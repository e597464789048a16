"""Where beam search's time goes, and the most that refilling free rows (continuous batching) could save.

    python bench/beam_bound.py --out bench/results/beam-bound.json

Beam search (`ende-base`, beam 5, 64 sentences a batch: 320 rows) decodes static batches of sentences
sorted by length; a batch's rows leave as its sentences finish, so the later steps of each batch run
on fewer rows. One run through the public API, with the model's `encode`/`cross_kv` and `decode`
timed from outside (instance attributes wrapping them):

- encoder: `encode` + `cross_kv`; decoder: every `decode` call with its row count; bookkeeping: the
  rest (log-softmax, top-k, finalization, reordering the cache, the API's tokenizing);
- per row at a full batch: the median over calls with every row live of decoder seconds / rows, and
  of the gap to the next call / rows (the search's own work for that step);
- bound: encoder + rows decoded x (decoder + bookkeeping per row at a full batch). Refilling rows as
  sentences finish changes which rows share a call, not the rows to decode, so no schedule of the
  same search runs below it (it also ignores what refilling costs: rows at different steps read
  their cache up to the longest row's length). `speedup_bound` = measured seconds / bound.
- what refilling would cost: in a schedule that refills every free row at once (longest sources
  first, each sentence taking the decoder calls it took here), each call's rows attend to, and its
  cache reorder copies, the longest live row's prefix; here a batch's rows share one length. The
  row-weighted mean of that span in both schedules, and a full batch's decoder call plus cache
  reorder timed at each (random inputs, uniform lengths), give `us_per_row_refill_cost`;
  `speedup_bound_refilled` charges it to every row of the bound.
- the decoder's arithmetic rate at a full batch: its products' floating-point operations per row
  (projections, feed-forward, output projection; attention aside) x rows / seconds, beside the rate
  of the output projection alone at the same rows.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from aggdec.decoding.methods import options_from_mapping  # noqa: E402
from aggdec.model.precision import cpu_isa  # noqa: E402
from tree_compare import add_test_set, open_test_set  # noqa: E402  (bench/ is this script's directory)


def timed(fn, log: list):
    """fn, appending (rows of its first argument, start, end) to `log` per call."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        log.append((args[0].shape[0], t0, time.perf_counter()))
        return out
    return wrapper


def products_flops_per_row(cfg) -> int:
    """Floating-point operations of one decoder row's matrix products: self-attention q/k/v/out and
    cross-attention q/out projections, feed-forward, output projection (cross K/V are per sentence)."""
    d = cfg.d_model
    per_layer = 4 * d * d + 2 * d * d + 2 * d * cfg.dec_ffn
    return 2 * (cfg.dec_layers * per_layer + d * cfg.tgt_vocab)


def schedules(steps: list[int], slots: int) -> dict[str, float]:
    """Row-weighted mean attention span (the longest live row's decoded length + 1) of the static
    schedule (batches of `slots` sentences in order) and of one that refills every free slot at each
    step; `steps`: each sentence's decoder calls, in admission order."""
    out = {}
    for name, refill in (("static", False), ("refilled", True)):
        queue, live, rows, weighted, calls = list(steps), [], 0, 0, 0
        while queue or live:
            if refill or not live:
                while queue and len(live) < slots:
                    live.append([queue.pop(0), 0])
            span = max(done for _, done in live) + 1
            rows, weighted, calls = rows + len(live), weighted + len(live) * span, calls + 1
            live = [[need, done + 1] for need, done in live if done + 1 < need]
        out[f"{name}_mean_span"] = round(weighted / rows, 2)
        out[f"{name}_calls"] = calls
    return out


def step_cost(model, sentences: int, beam: int, span: int, src_width: int, reps: int = 15) -> float:
    """Seconds per row of a decoder call plus a cache reorder (parents drawn within each sentence's
    beams) at `sentences` x `beam` rows whose cache holds `span` - 1 positions."""
    d = model.cfg.d_model
    with torch.no_grad():
        cache = model.start_from(torch.randn(sentences, src_width, d), torch.zeros(sentences, src_width, dtype=torch.bool),
                                 capacity=span + 8, group=beam, indirect=True)  # as beam search's
        cache.commit(span - 1)
        rows = sentences * beam
        tokens = torch.randint(4, model.cfg.tgt_vocab, (rows, 1))
        parents = (torch.arange(rows) // beam * beam + torch.randint(0, beam, (rows,)))
        times = []
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            model.decode(tokens, cache)
            cache.reorder(parents, span, take_cross=False)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) / rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_test_set(ap, 0)
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sources, tr = open_test_set(a)
    model = tr.model
    opts = options_from_mapping({"method": "beam", "beam": a.beam, "max_batch_size": a.batch_size}, "beam")[0]
    tr.translate_batch(sources[: 2 * a.batch_size], opts)  # warm-up

    decode_log: list = []
    encode_log: list = []
    model.decode = timed(model.decode, decode_log)
    model.encode = timed(model.encode, encode_log)
    model.cross_kv = timed(model.cross_kv, encode_log)
    t0 = time.perf_counter()
    results = tr.translate_batch(sources, opts)
    total = time.perf_counter() - t0

    full = a.batch_size * a.beam
    encoder = sum(e - s for _, s, e in encode_log)
    decoder = sum(e - s for _, s, e in decode_log)
    rows = sum(r for r, _, _ in decode_log)
    encodes = sorted(s for _, s, _ in encode_log)
    full_calls = [(e - s) / r for r, s, e in decode_log if r == full]
    gaps = [(nxt[1] - e) / r for (r, _, e), nxt in zip(decode_log, decode_log[1:])
            if r == full and not any(e <= s < nxt[1] for s in encodes)]
    decode_row, book_row = statistics.median(full_calls), statistics.median(gaps)
    bound = encoder + rows * (decode_row + book_row)
    order = sorted(range(len(results)), key=lambda i: results[i].src_len, reverse=True)  # admission order
    spans = schedules([results[i].stats.iterations for i in order], a.batch_size)
    model.decode = type(model).decode.__get__(model)  # unwrapped for the timings below
    src_width = round(statistics.mean(r.src_len for r in results))
    costs = {}
    for _ in range(3):  # interleaved
        for name in ("static", "refilled"):
            span = round(spans[f"{name}_mean_span"])
            costs.setdefault(name, []).append(step_cost(model, a.batch_size, a.beam, span, src_width))
    refill_cost = statistics.median(costs["refilled"]) - statistics.median(costs["static"])
    flops = products_flops_per_row(model.cfg)
    x = torch.randn(full, model.cfg.d_model)
    with torch.no_grad():
        model.output_logits(x)
        reps = []
        for _ in range(20):
            s = time.perf_counter()
            model.output_logits(x)
            reps.append(time.perf_counter() - s)
    out_rate = 2 * model.cfg.d_model * model.cfg.tgt_vocab * full / statistics.median(reps) / 1e9
    result = {
        "command": "python bench/beam_bound.py " + " ".join(argv or sys.argv[1:]),
        "cpu": platform.processor() or platform.machine(), "cpu_isa": cpu_isa(), "threads": a.threads,
        "sentences": len(sources), "beam": a.beam, "batch_size": a.batch_size, "seconds": round(total, 3),
        "sentences_per_s": round(len(sources) / total, 2),
        "decoder_calls": len(decode_log), "rows_decoded": rows, "mean_rows_per_call": round(rows / len(decode_log), 1),
        "occupancy": round(rows / len(decode_log) / full, 3),
        "seconds_encoder": round(encoder, 3), "seconds_decoder": round(decoder, 3),
        "seconds_bookkeeping": round(total - encoder - decoder, 3),
        "full_batch_calls": len(full_calls),
        "us_per_row_decoder_full": round(1e6 * decode_row, 2),
        "us_per_row_decoder_mean": round(1e6 * decoder / rows, 2),
        "us_per_row_bookkeeping_full": round(1e6 * book_row, 2),
        "us_per_row_bookkeeping_mean": round(1e6 * (total - encoder - decoder) / rows, 2),
        "seconds_bound": round(bound, 3), "speedup_bound": round(total / bound, 3),
        **spans, "us_per_row_step_static_span": round(1e6 * statistics.median(costs["static"]), 2),
        "us_per_row_step_refilled_span": round(1e6 * statistics.median(costs["refilled"]), 2),
        "us_per_row_refill_cost": round(1e6 * refill_cost, 2),
        "speedup_bound_refilled": round(total / (bound + rows * max(0.0, refill_cost)), 3),
        "decoder_products_gflops_full": round(flops / decode_row / 1e9, 1),
        "output_projection_gflops_alone": round(out_rate, 1),
    }
    print(json.dumps(result, indent=2))
    if a.out:
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

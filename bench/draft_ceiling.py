"""What a drafter must cost and how often it must be right for GAD to pay, measured with an oracle.

    python bench/draft_ceiling.py --batch-sizes 1,64 --bs1-limit 100 --limit 1000 --repeat 3 \
        --out bench/results/draft-ceiling.json

An oracle drafter proposes the next k tokens of each row's greedy output (decoded first), each
right with probability q given that the ones before it were right (a wrong token is another id), so
a call accepts about q + q^2 + ... + q^k draft tokens. It runs no model. Per batch size the script
decodes ende/test with greedy, with the trained draft head at every k of `--lengths` and with the
oracle at every (k, q) of `--lengths` x `--accuracies` (gad with exact top-1 verification of every
drafted token: draft_length "max"), interleaved, and reports per configuration (medians of `--repeat`):

- `tokens_per_call`: output tokens per verifier call of a row;
- `ms_per_call` V: the loop's time per verifier call (all rows) without the drafter's own time
  (for the oracle, its bookkeeping is left out as well);
- `x_greedy_free`: N * g / V, the speedup over greedy of a drafter this accurate that costs nothing
  (N: output tokens per call, all rows; g: greedy's loop time per output token);
- `drafter_ms_for_1x`, `_1.5x`, `_2x`: the most a drafter this accurate may cost per call (ms) for
  that speedup, N * g / x - V (negative: not reachable at any cost).

For the draft head, `drafter_ms_per_call` is what it does cost. Outputs of the oracle runs are
checked identical to greedy (the oracle at q < 1 exercises rejection). Not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from baseline_bench import machine
from gad_bench import decode

from aggdec.api import Translator, decode_options
from aggdec.decoding.metadata import DraftBatch
from aggdec.train.ar import read_tsv


class OracleDrafter:
    """Drafts row b's next `k` greedy tokens (from `reference`, index -> tokens without eos), each
    right with probability `q` while the ones before it were right; no model, no state per row."""

    name = "oracle"

    def __init__(self, reference: dict[int, list[int]], k: int, q: float, eos: int, pad: int, vocab: int,
                 seed: int = 0):
        self.reference, self.k, self.q = reference, k, q
        self.eos, self.pad, self.vocab = eos, pad, vocab
        self.max_draft = k
        self.rng = random.Random(seed)

    def admit(self, state, slots) -> None:
        pass

    def select(self, rows) -> None:
        pass

    def _wrong(self, token: int) -> int:
        other = (token + 1) % self.vocab
        return other if other != self.pad else (other + 1) % self.vocab

    def propose(self, state) -> DraftBatch:
        generated = state.generated.tolist()
        rows, counts = [], []
        for req, g in zip(state.requests, generated):
            seq = self.reference[req.index] + [self.eos]
            draft = seq[g: g + self.k]
            for i, token in enumerate(draft):
                if self.rng.random() >= self.q:
                    draft[i] = self._wrong(token)
                    break
            rows.append(draft + [self.pad] * (self.k - len(draft)))
            counts.append(len(draft))
        return DraftBatch(tokens=torch.tensor(rows, dtype=torch.long), num_draft=torch.tensor(counts))

    def observe(self, state, draft, accepted, hidden) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/ende-base")
    ap.add_argument("--draft-head", default="models/ende-base-draft-head")
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "ende" / "test.tsv"))
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--bs1-limit", type=int, default=100)
    ap.add_argument("--lengths", default="1,2,4")
    ap.add_argument("--accuracies", default="1.0,0.8,0.65,0.5")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/draft-ceiling.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tr = Translator.load(args.model)
    cfg = tr.cfg
    sources = read_tsv(args.data, "en", "de")[0][: args.limit]
    lengths = [int(k) for k in args.lengths.split(",")]
    accuracies = [float(q) for q in args.accuracies.split(",")]
    tr.translate_batch(sources[:16], max_batch_size=16)  # warm-up
    results = {"model": args.model, "draft_head": args.draft_head, "machine": machine("cpu"),
               "threads": args.threads, "torch": torch.__version__, "runs": []}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        greedy = decode_options("greedy", max_batch_size=bs)
        src = sources[: args.bs1_limit if bs == 1 else args.limit]
        reference = {i: h.tokens for i, h in enumerate(decode(tr, greedy, src)[0])}
        configs = {"greedy": (greedy, None)}
        for k in lengths:
            configs[f"head-k{k}"] = (decode_options("gad", drafter=args.draft_head, block_size=k, draft_length="max",
                                                    max_batch_size=bs), None)
            for q in accuracies:
                configs[f"oracle-k{k}-q{q}"] = (decode_options("gad", drafter=args.draft_head, block_size=k,
                                                               draft_length="max", max_batch_size=bs), (k, q))
        measured: dict[str, list[dict]] = {name: [] for name in configs}
        for rep in range(args.repeat):
            for name, (opts, oracle) in configs.items():
                drafter = None if oracle is None else OracleDrafter(reference, *oracle, cfg.eos, cfg.pad,
                                                                    cfg.tgt_vocab, seed=rep)
                out, info = decode(tr, opts, src, drafter)
                measured[name].append({
                    "seconds": info["seconds"], "drafter_seconds": info["draft_seconds"], "calls": info["calls"],
                    "row_calls": info["row_calls"], "tokens": sum(len(h.tokens) + 1 for h in out),
                    "identical": statistics.mean(h.tokens == reference[i] for i, h in enumerate(out))})
        # greedy's loop time per output token, ms
        g_tok = statistics.median(1e3 * m["seconds"] / m["tokens"] for m in measured["greedy"])
        for name, infos in measured.items():
            secs = statistics.median(m["seconds"] for m in infos)
            calls = statistics.median(m["calls"] for m in infos)
            tokens = infos[0]["tokens"]
            v = statistics.median(1e3 * (m["seconds"] - m["drafter_seconds"]) / m["calls"] for m in infos)
            d = statistics.median(1e3 * m["drafter_seconds"] / m["calls"] for m in infos)
            per_call = tokens / calls * g_tok  # greedy's time for one call's output tokens
            row = {"config": name, "batch_size": bs, "sentences": len(src), "sentences_per_s": len(src) / secs,
                   "x_greedy": statistics.median(measured["greedy"][i]["seconds"] / m["seconds"]
                                                 for i, m in enumerate(infos)),
                   "tokens_per_call": tokens / statistics.median(m["row_calls"] for m in infos),
                   "ms_per_call": v, "x_greedy_free": per_call / v,
                   "identical_to_greedy": min(m["identical"] for m in infos), "raw": infos}
            if name.startswith("head"):
                row["drafter_ms_per_call"] = d
            for x in (1.0, 1.5, 2.0):
                row[f"drafter_ms_for_{x:g}x"] = per_call / x - v
            results["runs"].append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items() if k != "raw"}),
                  flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

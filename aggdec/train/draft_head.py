"""Train GAD's draft head (aggdec.model.draft_head) on a frozen verifier, on the CPU.

Two steps. `features` decodes the training sources with the verifier's own greedy decoding (the
Seq-KD targets, as token ids) and stores, once, what the head reads: the encoder output of every
source and the verifier's final decoder state at every target position, teacher-forced on its own
output (float16, a few GB for 128k pairs). `train` then trains only the head on them: per target
position t the head gets the state h_t and the token it produced, y_{t+1}, and learns the next k
tokens y_{t+2} .. y_{t+k+1} (eos included; nothing after it).

    python -m aggdec.train.draft_head features --verifier models/ende-base \
        --data ../shared/data/ende/train.tsv --column en --out runs/ende-head
    python -m aggdec.train.draft_head train --verifier models/ende-base --features runs/ende-head \
        --out models/ende-base-draft-head --block-size 4 --layers 1 --max-minutes 30

`train` reports teacher-forced accuracy at each draft position and the mean accepted tokens per
call (the accepted prefix of the drafts, as exact-match verification keeps it) on held-out pairs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from aggdec import checkpoint
from aggdec.api import Translator
from aggdec.decoding.limits import max_len_for
from aggdec.decoding.metadata import Request
from aggdec.decoding.options import DecodeOptions
from aggdec.decoding.scheduler import pad_batch
from aggdec.decoding.slot_loop import SlotLoop
from aggdec.model.draft_head import DraftHead, DraftHeadConfig
from aggdec.model.transformer import Transformer
from aggdec.train.ar import log, read_tsv, training_autocast

ARRAYS = ("src_tok", "src_off", "tgt_tok", "tgt_off", "memory", "hidden", "self_k", "self_v")
STATES = ("memory", "hidden", "self_k", "self_v")


# -- features -------------------------------------------------------------------------------------

@torch.no_grad()
def extract_features(verifier: str | Path, sources: list[str], out: str | Path, *, batch_size: int = 64,
                     chunk: int = 4096) -> dict:
    """Greedy-decode `sources` with the verifier and store the head's inputs under `out`: the token
    ids (src_tok/src_off: sources incl. eos; tgt_tok/tgt_off: greedy outputs incl. eos), then the
    verifier's states on them (`store_states`). -> summary."""
    tr = Translator.load(verifier)
    model, cfg = tr.model, tr.cfg
    opts = DecodeOptions()
    src_ids = [ids for ids, _, _ in map(tr.prepare, sources) if ids is not None]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tgt_ids: list[list[int]] = []
    t0 = time.time()
    for start in range(0, len(src_ids), chunk):
        reqs = [Request(index=i, src=s, max_len=max(1, max_len_for(len(s), opts.max_len_a, opts.max_len_b,
                                                                   cfg.max_target_positions)))
                for i, s in enumerate(src_ids[start: start + chunk])]
        loop = SlotLoop(model, max_batch_size=batch_size, prompt=tr.framing().prompt)
        hyps = sorted(loop.run(reqs), key=lambda h: h.index)
        tgt_ids += [h.tokens + [cfg.eos] for h in hyps]
        log(f"decoded {len(tgt_ids)}/{len(src_ids)} ({len(tgt_ids) / (time.time() - t0):.1f} sent/s)")
    for name, seqs in (("src", src_ids), ("tgt", tgt_ids)):
        np.save(out / f"{name}_tok.npy", np.concatenate([np.asarray(x, dtype=np.int32) for x in seqs]))
        np.save(out / f"{name}_off.npy", np.concatenate([[0], np.cumsum([len(x) for x in seqs])]).astype(np.int64))
    decode_minutes = (time.time() - t0) / 60
    summary = store_states(tr, out, batch_size=batch_size)
    summary["decode_minutes"] = round(decode_minutes, 2)
    (out / "features.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


@torch.no_grad()
def store_states(tr: Translator, out: Path, *, batch_size: int = 64) -> dict:
    """The verifier's states on the stored token ids, teacher-forced, as float16 arrays: memory
    (encoder output, sum S x D), hidden (final decoder state at every target position, sum T x D),
    self_k / self_v (the last decoder layer's self-attention keys/values there, sum T x E, E the
    attention's width: a T5's heads * d_kv). The decoder is fed the model's start token first."""
    model, cfg = tr.model, tr.cfg
    src_tok, src_off = np.load(out / "src_tok.npy"), np.load(out / "src_off.npy")
    tgt_tok, tgt_off = np.load(out / "tgt_tok.npy"), np.load(out / "tgt_off.npy")
    n, start = len(src_off) - 1, tr.framing().start
    width = {"memory": cfg.d_model, "hidden": cfg.d_model, "self_k": cfg.inner_dim(cfg.dec_heads),
             "self_v": cfg.inner_dim(cfg.dec_heads)}
    arrays = {k: np.lib.format.open_memmap(out / f"{k}.npy", mode="w+", dtype=np.float16,
                                           shape=(int((src_off if k == "memory" else tgt_off)[-1]), width[k]))
              for k in STATES}
    order = sorted(range(n), key=lambda i: int(src_off[i + 1] - src_off[i]))
    agree, t0 = 0, time.time()
    for b in range(0, n, batch_size):
        idx = order[b: b + batch_size]
        srcs = [src_tok[src_off[i]: src_off[i + 1]].tolist() for i in idx]
        tgts = [tgt_tok[tgt_off[i]: tgt_off[i + 1]].tolist() for i in idx]
        memory, src_pad = model.encode(pad_batch(srcs, cfg.pad))
        prev = pad_batch([[start] + t[:-1] for t in tgts], cfg.pad)
        cache = model.start_from(memory, src_pad, capacity=prev.shape[1])
        hidden = model.decode_hidden(prev, cache)
        pred = model.output_logits(hidden).argmax(-1)
        for r, i in enumerate(idx):
            s, t = len(srcs[r]), len(tgts[r])
            arrays["memory"][src_off[i]: src_off[i + 1]] = memory[r, :s].half().numpy()
            arrays["hidden"][tgt_off[i]: tgt_off[i + 1]] = hidden[r, :t].half().numpy()
            arrays["self_k"][tgt_off[i]: tgt_off[i + 1]] = cache.k[-1][r, :t].half().numpy()
            arrays["self_v"][tgt_off[i]: tgt_off[i + 1]] = cache.v[-1][r, :t].half().numpy()
            agree += int((pred[r, :t] == torch.tensor(tgts[r])).sum())
        if (b // batch_size) % 200 == 0:
            log(f"states {b + len(idx)}/{n}")
    for a in arrays.values():
        a.flush()
    return {"pairs": n, "target_tokens": int(tgt_off[-1]), "source_tokens": int(src_off[-1]),
            "verifier_sha": tr.bundle.sha, "argmax_agreement": agree / max(int(tgt_off[-1]), 1),
            "state_minutes": round((time.time() - t0) / 60, 2)}


class Features:
    """The arrays written by `extract_features`, memory-mapped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = json.loads((self.path / "features.json").read_text())
        for k in ARRAYS:
            setattr(self, k, np.load(self.path / f"{k}.npy", mmap_mode="r"))

    def __len__(self) -> int:
        return len(self.src_off) - 1

    def target(self, i: int) -> np.ndarray:
        return self.tgt_tok[self.tgt_off[i]: self.tgt_off[i + 1]]

    def batch(self, idx: list[int], pad: int) -> dict[str, torch.Tensor]:
        """-> memory (B,S,D) float32, src_pad (B,S), hidden (B,T,D), self_k, self_v (B,T,E) float32, tokens (B,T)
        (pad-filled)."""
        s_len = [int(self.src_off[i + 1] - self.src_off[i]) for i in idx]
        t_len = [int(self.tgt_off[i + 1] - self.tgt_off[i]) for i in idx]
        b = len(idx)
        out = {"memory": np.zeros((b, max(s_len), self.memory.shape[1]), dtype=np.float32),
               **{k: np.zeros((b, max(t_len), getattr(self, k).shape[1]), dtype=np.float32)
                  for k in ("hidden", "self_k", "self_v")},
               "tokens": np.full((b, max(t_len)), pad, dtype=np.int64), "src_pad": np.ones((b, max(s_len)), dtype=bool)}
        for r, i in enumerate(idx):
            src, tgt = slice(self.src_off[i], self.src_off[i + 1]), slice(self.tgt_off[i], self.tgt_off[i + 1])
            out["memory"][r, : s_len[r]] = self.memory[src]
            for k in ("hidden", "self_k", "self_v"):
                out[k][r, : t_len[r]] = getattr(self, k)[tgt]
            out["tokens"][r, : t_len[r]] = self.tgt_tok[tgt]
            out["src_pad"][r, : s_len[r]] = False
        return {k: torch.from_numpy(v) for k, v in out.items()}


# -- training -------------------------------------------------------------------------------------

def block_targets(tokens: torch.Tensor, k: int, pad: int, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (B,T): the token each position's verifier state produced (y_{t+1}), pad-filled.
    -> (targets (B,T,k): y_{t+2} .. y_{t+k+1}, pad past the end; valid (B,T): positions whose
    produced token is neither pad nor eos, i.e. where the loop would draft)."""
    b, t = tokens.shape
    padded = F.pad(tokens, (0, k), value=pad)
    targets = torch.stack([padded[:, 1 + i: 1 + i + t] for i in range(k)], dim=2)
    # nothing is drafted after an eos: a target after the first eos in the block is pad
    after_eos = torch.cumsum((targets == eos).long(), dim=2) - (targets == eos).long() > 0
    targets = targets.masked_fill(after_eos, pad)
    valid = (tokens != pad) & (tokens != eos)
    return targets, valid


def draft_vocabulary(feats: Features, size: int) -> torch.Tensor:
    """The `size` most frequent target tokens (ids ascending), 0 = all."""
    counts = np.bincount(np.asarray(feats.tgt_tok), minlength=1)
    order = np.argsort(-counts, kind="stable")[:size]
    return torch.from_numpy(np.sort(order)).long()


def head_logits(head: DraftHead, verifier: Transformer, batch: dict, valid: torch.Tensor, k: int,
                out_weight: torch.Tensor) -> torch.Tensor:
    """(N,k,V_draft) draft logits at the `valid` (B,T) positions (row-major) of a `Features.batch`, for
    training and evaluation. The example at position t sees the verifier's prefix keys/values 0..t."""
    last = verifier.decoder.layers[-1].encoder_attn
    b, t = valid.shape
    rows = torch.arange(b)[:, None].expand_as(valid)[valid]
    pos = torch.arange(t)[None].expand_as(valid)[valid]
    with torch.no_grad():
        memory = batch["memory"]
        cross_k, cross_v = last.k_proj(memory)[rows], last.v_proj(memory)[rows]
        emb = verifier.decoder.embed_scale * verifier.decoder.embed_tokens(batch["tokens"][valid])
    keep = torch.arange(t)[None] <= pos[:, None]
    states = head.states(batch["hidden"][valid], emb, batch["self_k"][rows], batch["self_v"][rows], keep,
                         cross_k, cross_v, batch["src_pad"][rows], k)
    return states @ out_weight.T


def accepted_prefix(pred: torch.Tensor, targets: torch.Tensor, pad: int) -> torch.Tensor:
    """(N,k) predictions vs targets -> (N,) drafts exact-match verification keeps: the longest
    prefix of correct predictions (a position whose target is pad was never drafted)."""
    ok = (pred == targets) & (targets != pad)
    return torch.cumprod(ok.long(), dim=1).sum(dim=1)


def evaluate(head, verifier, feats: Features, idx: list[int], out_weight, vocab_map, k: int, pad: int, eos: int,
             batch: int = 64) -> dict:
    """Teacher-forced accuracy by draft position and mean accepted drafts per call on pairs `idx`."""
    correct, seen, accepted, calls = torch.zeros(k), torch.zeros(k), 0, 0
    head.eval()
    with torch.no_grad():
        for s in range(0, len(idx), batch):
            data = feats.batch(idx[s: s + batch], pad)
            targets, valid = block_targets(data["tokens"], k, pad, eos)
            logits = head_logits(head, verifier, data, valid, k, out_weight)
            p = head.vocab[logits.argmax(-1)] if vocab_map is not None else logits.argmax(-1)
            t = targets[valid]
            drafted = t != pad
            correct += ((p == t) & drafted).sum(0).float()
            seen += drafted.sum(0).float()
            accepted += int(accepted_prefix(p, t, pad).sum())
            calls += int(valid.sum())
    head.train()
    return {"accuracy_by_position": [round(float(c / max(n, 1)), 4) for c, n in zip(correct, seen)],
            "mean_accepted_per_call": accepted / max(calls, 1), "positions": calls}


def train(a: argparse.Namespace) -> Path:
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    ver = checkpoint.load(a.verifier)
    verifier = ver.model.float().eval()
    for p in verifier.parameters():
        p.requires_grad_(False)
    cfg = verifier.cfg
    feats = Features(a.features)
    if feats.meta["verifier_sha"] != ver.sha:
        raise SystemExit(f"{a.features}: features of verifier {feats.meta['verifier_sha']}, not {ver.sha}")
    n = len(feats)
    held = list(range(n - a.valid, n))
    train_idx = list(range(n - a.valid))
    k = a.block_size
    hcfg = DraftHeadConfig(d_model=cfg.d_model, heads=cfg.dec_heads, kv_dim=cfg.inner_dim(cfg.dec_heads), ffn=a.ffn,
                           layers=a.layers, block_size=k, draft_vocab=a.draft_vocab)
    head = DraftHead(hcfg)
    _init_from_verifier(head, verifier)
    vocab_map = None
    if a.draft_vocab:
        head.vocab.copy_(draft_vocabulary(feats, a.draft_vocab))
        vocab_map = torch.full((cfg.tgt_vocab,), -100, dtype=torch.long)
        vocab_map[head.vocab] = torch.arange(a.draft_vocab)
    out_weight = verifier.output_weight.detach()[head.vocab] if a.draft_vocab else verifier.output_weight.detach()
    weights = torch.tensor([a.position_decay**i for i in range(k)])
    opt = torch.optim.AdamW(head.parameters(), lr=a.lr, betas=(0.9, 0.98), weight_decay=0.01)
    amp = training_autocast("cpu", a.bf16)
    lengths = np.diff(np.asarray(feats.tgt_off))[: n - a.valid]
    deadline = time.time() + 60 * a.max_minutes
    step, t0, seen_pos, loss_win = 0, time.time(), 0, []
    log(f"draft head {json.dumps(hcfg.to_dict())}; {sum(p.numel() for p in head.parameters())} parameters; "
        f"{len(train_idx)} training pairs, {a.valid} held out")
    while time.time() < deadline and (not a.max_updates or step < a.max_updates):
        idx = _length_batch(rng, train_idx, lengths, a.positions)
        data = feats.batch(idx, cfg.pad)
        targets, valid = block_targets(data["tokens"], k, cfg.pad, cfg.eos)
        if vocab_map is not None:
            targets = torch.where(targets == cfg.pad, -100, vocab_map[targets])
        else:
            targets = targets.masked_fill(targets == cfg.pad, -100)
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * max(0.0, 1 - (time.time() - t0) / (60 * a.max_minutes)))
        for g in opt.param_groups:
            g["lr"] = lr
        with amp:
            logits = head_logits(head, verifier, data, valid, k, out_weight)
        logits, tgt = logits.float(), targets[valid]  # (N,k,V), (N,k)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100,
                              reduction="none", label_smoothing=a.label_smoothing).view(tgt.shape)
        mask = (tgt != -100).float()
        loss = (nll * mask * weights).sum() / (mask * weights).sum().clamp(min=1)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        seen_pos += int(valid.sum())
        loss_win.append(loss.item())
        if step % a.log_interval == 0:
            log(f"update {step} loss {np.mean(loss_win):.3f} lr {lr:.2e} "
                f"{seen_pos / (time.time() - t0):.0f} positions/s ({(time.time() - t0) / 60:.1f} min)")
            loss_win = []
    minutes = (time.time() - t0) / 60
    result = evaluate(head, verifier, feats, held, out_weight, vocab_map, k, cfg.pad, cfg.eos)
    log(f"held-out {json.dumps(result)}")
    meta = {"verifier_sha": ver.sha, "updates": step, "minutes": round(minutes, 2), "positions_seen": seen_pos,
            "features": feats.meta, "held_out": result, "args": {k_: v for k_, v in vars(a).items()
                                                                  if k_ not in ("verifier", "features", "out", "func")}}
    return checkpoint.save_draft_head(a.out, head, meta)


def _length_batch(rng: random.Random, idx: list[int], lengths: np.ndarray, positions: int) -> list[int]:
    """Random pairs of similar target length, about `positions` target positions in all."""
    pivot = rng.choice(idx)
    width = lengths[pivot]
    pool = [rng.choice(idx) for _ in range(8 * max(1, positions // max(int(width), 1)))]
    pool.sort(key=lambda i: abs(int(lengths[i]) - int(width)))
    return pool[: max(1, positions // max(int(width), 1))]


def _init_from_verifier(head: DraftHead, verifier: Transformer) -> None:
    """Start the head's layers from the verifier's last decoder layer (attention, FFN where it has the
    head's shape and is not gated, norms): each tensor the verifier has in the same shape (a T5's
    layers and RMS norms have no biases: those keep their initialization)."""
    last = verifier.decoder.layers[-1]
    pairs = [(head.norm, verifier.decoder.layer_norm)] if verifier.decoder.layer_norm is not None else []
    for layer in head.layers:
        pairs += [(getattr(layer.self_attn, n), getattr(last.self_attn, n))
                  for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
        pairs += [(getattr(layer.cross_attn, n), getattr(last.encoder_attn, n)) for n in ("q_proj", "out_proj")]
        pairs += [(layer.norm1, last.self_attn_layer_norm), (layer.norm2, last.encoder_attn_layer_norm),
                  (layer.norm3, last.final_layer_norm)]
        if layer.fc1.weight.shape == last.fc1.weight.shape and last.fc3 is None:
            pairs += [(layer.fc1, last.fc1), (layer.fc2, last.fc2)]
    with torch.no_grad():
        for ours, theirs in pairs:
            mine = dict(ours.named_parameters())
            for name, p in theirs.named_parameters():
                if name in mine and mine[name].shape == p.shape:
                    mine[name].copy_(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aggdec.train.draft_head", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    f = sub.add_parser("features", help="greedy-decode the sources and store the head's inputs")
    f.add_argument("--verifier", required=True)
    f.add_argument("--data", required=True, help="TSV with a header line")
    f.add_argument("--column", required=True, help="source column")
    f.add_argument("--out", required=True)
    f.add_argument("--limit", type=int, default=0)
    f.add_argument("--threads", type=int, default=2)
    st = sub.add_parser("states", help="recompute the verifier's states of a features directory's token ids")
    st.add_argument("--verifier", required=True)
    st.add_argument("--features", required=True)
    st.add_argument("--threads", type=int, default=2)
    t = sub.add_parser("train", help="train a draft head on stored features")
    t.add_argument("--verifier", required=True)
    t.add_argument("--features", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--block-size", type=int, default=4)
    t.add_argument("--layers", type=int, default=1)
    t.add_argument("--ffn", type=int, default=1024)
    t.add_argument("--draft-vocab", type=int, default=0, help="draft only the N most frequent target tokens")
    t.add_argument("--positions", type=int, default=2048, help="target positions per update")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=200)
    t.add_argument("--position-decay", type=float, default=0.8, help="loss weight of draft position i: decay**i")
    t.add_argument("--label-smoothing", type=float, default=0.0)
    t.add_argument("--max-minutes", type=float, default=30)
    t.add_argument("--max-updates", type=int, default=0)
    t.add_argument("--valid", type=int, default=1000, help="held-out pairs (the last ones)")
    t.add_argument("--bf16", action="store_true")
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--seed", type=int, default=1)
    t.add_argument("--log-interval", type=int, default=50)
    a = ap.parse_args(argv)
    if a.command == "features":
        torch.set_num_threads(a.threads)
        src, _ = read_tsv(a.data, a.column, a.column)
        if a.limit:
            src = src[: a.limit]
        log(f"wrote {json.dumps(extract_features(a.verifier, src, a.out))}")
    elif a.command == "states":
        torch.set_num_threads(a.threads)
        out = Path(a.features)
        summary = {**json.loads((out / "features.json").read_text()), **store_states(Translator.load(a.verifier), out)}
        (out / "features.json").write_text(json.dumps(summary, indent=2) + "\n")
        log(f"wrote {json.dumps(summary)}")
    else:
        log(f"saved draft head to {train(a)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

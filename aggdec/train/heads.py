"""Train blockwise proposal heads (Stern et al. 2018) on a frozen verifier, on Seq-KD data.

Head i at position t predicts the target at t + i from the verifier's final decoder state; the
verifier's own output projection scores the heads' states.

    python -m aggdec.train.heads --verifier models/ende-base --data runs/ende-kd.tsv \
        --out models/ende-base-heads --block-size 4 --max-minutes 15
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch

from aggdec import checkpoint
from aggdec.checkpoint import save_heads
from aggdec.model.heads import ProposalHeads
from aggdec.train.ar import (
    PAD,
    collate,
    encode_pairs,
    log,
    ls_loss,
    make_batches,
    read_tsv,
    to_device,
    training_autocast,
)
from aggdec.train.args import heads_args


def _schedule(step: int, lr: float, warmup: int) -> float:
    return lr * min(step / warmup, math.sqrt(warmup / max(step, 1)))


def train_heads(a: argparse.Namespace) -> Path:
    """k-1 heads on the frozen verifier: head i at position t predicts target t + i (Seq-KD data)."""
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    ver = checkpoint.load(a.verifier)
    verifier = ver.model.eval().to(a.device)
    for p in verifier.parameters():
        p.requires_grad_(False)
    heads = ProposalHeads(verifier.cfg.d_model, a.block_size - 1, a.hidden).to(a.device)
    amp = training_autocast(a.device, a.bf16)
    src_txt, tgt_txt = read_tsv(a.data, a.src_col, a.tgt_col)
    src, tgt = encode_pairs(ver.src_tok, src_txt, tgt_txt, verifier.cfg.max_target_positions - 1)
    opt = torch.optim.Adam(heads.parameters(), lr=a.lr, betas=(0.9, 0.98))
    deadline = time.time() + 60 * a.max_minutes
    step, t0, win = 0, time.time(), [0.0, 0]
    t_win = t0
    while time.time() < deadline:
        for idx in make_batches(src, tgt, a.max_tokens, rng):
            step += 1
            for g in opt.param_groups:
                g["lr"] = _schedule(step, a.lr, a.warmup)
            s, prev, target = to_device(collate(src, tgt, idx, a.pad_multiple), a.device)
            with torch.no_grad(), amp:
                h = verifier(s, prev, return_hidden=True)  # (B,T,D)
            b, t, d = h.shape
            loss_sum, n_sum = 0.0, 0
            with amp:
                states = heads(h.reshape(-1, d)).view(b, t, heads.num_heads, d)
                for i in range(1, heads.num_heads + 1):
                    scored = target[:, i:].ne(PAD)  # boolean selection also makes the rows contiguous
                    logits = verifier.output_logits(states[:, : t - i, i - 1][scored])
                    loss, nll, n = ls_loss(logits, target[:, i:][scored], a.label_smoothing)
                    loss_sum = loss_sum + loss
                    n_sum += n
                    win[0] += float(nll.detach())
                    win[1] += n
            opt.zero_grad(set_to_none=True)
            (loss_sum / max(n_sum, 1)).backward()
            opt.step()
            if step % a.log_interval == 0:
                log(f"heads | update {step} | nll {win[0] / max(win[1], 1):.4f} "
                    f"| tgt tok/s {win[1] / (time.time() - t_win):.0f} | {(time.time() - t0) / 60:.1f} min")
                t_win = time.time()
                win = [0.0, 0]
            if time.time() >= deadline:
                break
    out = Path(a.out)
    save_heads(out, heads.cpu(), {"verifier_sha": ver.sha, "block_size": a.block_size, "updates": step,
                            "minutes": round((time.time() - t0) / 60, 2), "recipe": " ".join(sys.argv)})
    log(f"saved heads to {out} after {step} updates")
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry (flags: aggdec.train.args.heads_args)."""
    train_heads(heads_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

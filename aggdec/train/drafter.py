"""Train GAD's NAR block drafter (and blockwise proposal heads) on Seq-KD data.

Drafter (block mask + glancing, Xia et al.): cut each target at a random point c, keep the gold
prefix, and predict y_{c+1} .. y_{c+k} from k mask tokens in one pass (prefix causal, masks
bidirectional: the same layout as `aggdec.decoding.nat`). Glancing: a first pass without gradient
counts each row's wrong predictions; that many times `glance` of the masks (annealed to 0) are
replaced by the gold token, and the loss covers the masks left.

    python -m aggdec.train.drafter drafter --verifier models/ende-base --data runs/ende-kd.tsv \
        --out models/ende-base-drafter --block-size 10 --max-minutes 30
    python -m aggdec.train.drafter heads --verifier models/ende-base --data runs/ende-kd.tsv \
        --out models/ende-base-heads --block-size 4 --max-minutes 15
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from aggdec import checkpoint
from aggdec.checkpoint import save_heads
from aggdec.model.heads import ProposalHeads
from aggdec.model.config import ModelConfig
from aggdec.model.transformer import Transformer
from aggdec.train.ar import EOS, PAD, collate, encode_pairs, init_weights, log, ls_loss, make_batches, read_tsv, round_up, to_device, training_autocast

def drafter_config(verifier: ModelConfig, dec_layers: int) -> ModelConfig:
    """The drafter: the verifier's shape, a shallow decoder, one extra target symbol (the mask)."""
    d = verifier.to_dict()
    d.update(tgt_vocab=verifier.tgt_vocab + 1, dec_layers=dec_layers, share_all_embeddings=False,
             share_decoder_input_output_embed=True, dec_learned_pos=False)
    return ModelConfig(**d)


def init_from_verifier(drafter: Transformer, verifier: Transformer) -> None:
    """Copy the encoder, the target embeddings and the first decoder layers from the verifier."""
    with torch.no_grad():
        drafter.encoder.load_state_dict(verifier.encoder.state_dict())
        v = verifier.cfg.tgt_vocab
        drafter.decoder.embed_tokens.weight[:v] = verifier.decoder.embed_tokens.weight
        for dst, src in zip(drafter.decoder.layers, verifier.decoder.layers):
            dst.load_state_dict(src.state_dict())
        if drafter.decoder.layer_norm is not None and verifier.decoder.layer_norm is not None:
            drafter.decoder.layer_norm.load_state_dict(verifier.decoder.layer_norm.state_dict())


def block_batch(src, tgt, idx, k: int, mask_id: int, rng: random.Random, multiple: int = 1):
    """A training batch of pairs `idx`, each cut at a random point (see `block_layout_batch`)."""
    cuts = [rng.randint(0, len(tgt[i])) for i in idx]
    return block_layout_batch([src[i] for i in idx], [tgt[i] for i in idx], cuts, k, mask_id, multiple)


def block_layout_batch(src, tgt, cuts: list[int], k: int, mask_id: int, multiple: int = 1):
    """Rows (src ids, tgt ids, both without eos; cut 0 <= c <= len(tgt)) ->
    src (B,S) [ids, eos], seq (B,T) = [eos, y_1..y_c, k masks], key_limit (B,T), target (B,T): the gold
    y_{c+1}..y_{c+k} (eos after the last token) at the masks, pad elsewhere. Widths are rounded up
    to `multiple`; trailing pad queries are outside the loss."""
    b = len(src)
    s_w = round_up(max(len(a) for a in src) + 1, multiple)
    t_w = round_up(max(cuts) + 1 + k, multiple)
    s = np.full((b, s_w), PAD, dtype=np.int64)
    seq = np.full((b, t_w), PAD, dtype=np.int64)
    target = np.full((b, t_w), PAD, dtype=np.int64)
    limit = np.tile(np.arange(t_w, dtype=np.int64), (b, 1))
    for r, (a, y, c) in enumerate(zip(src, tgt, cuts)):
        s[r, : len(a)] = a
        s[r, len(a)] = EOS
        seq[r, 0] = EOS
        seq[r, 1 : c + 1] = y[:c]
        seq[r, c + 1 : c + 1 + k] = mask_id
        gold = y[c : c + k]
        target[r, c + 1 : c + 1 + len(gold)] = gold
        if len(gold) < k:  # the block reaches past the end: its next gold token is eos
            target[r, c + 1 + len(gold)] = EOS
        limit[r, c + 1 : c + 1 + k] = c + k
    return tuple(torch.from_numpy(x) for x in (s, seq, limit, target))


def _schedule(step: int, lr: float, warmup: int) -> float:
    return lr * min(step / warmup, math.sqrt(warmup / max(step, 1)))


def train_drafter(a: argparse.Namespace) -> Path:
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    ver = checkpoint.load(a.verifier)
    prior = {"updates": 0, "minutes": 0.0}
    if a.init_from:
        bundle = checkpoint.load(a.init_from)
        if bundle.meta.get("role") != "nar-drafter" or bundle.meta.get("verifier_sha") != ver.sha:
            raise SystemExit(f"--init-from {a.init_from}: not a NAR drafter of verifier {a.verifier} (sha {ver.sha})")
        model, mcfg = bundle.model.float(), bundle.model.cfg
        prior = {k: bundle.meta.get(k, 0) for k in prior}
    else:
        mcfg = drafter_config(ver.model.cfg, a.dec_layers)
        model = Transformer(mcfg)
        init_weights(model)
        if a.init_from_verifier:
            init_from_verifier(model, ver.model)
    mask_id = mcfg.tgt_vocab - 1
    model = model.to(a.device)
    amp = training_autocast(a.device, a.bf16)
    src_txt, tgt_txt = read_tsv(a.data, a.src_col, a.tgt_col)
    src, tgt = encode_pairs(ver.src_tok, src_txt, tgt_txt, mcfg.max_target_positions - a.block_size - 2)
    log(f"drafter {json.dumps(mcfg.to_dict())}; {len(src)} pairs; mask id {mask_id}")
    opt = torch.optim.Adam(model.parameters(), lr=a.lr, betas=(0.9, 0.98))
    out = Path(a.out)
    deadline = time.time() + 60 * a.max_minutes
    step, t0, win = 0, time.time(), [0.0, 0]
    t_win = t0
    model.train()
    while time.time() < deadline:
        for idx in make_batches(src, tgt, a.max_tokens, rng):
            step += 1
            for g in opt.param_groups:
                g["lr"] = _schedule(step, a.lr, a.warmup)
            s, seq, limit, target = to_device(block_batch(src, tgt, idx, a.block_size, mask_id, rng, a.pad_multiple), a.device)
            glance = a.glance * max(0.0, 1 - (time.time() - t0) / (60 * a.max_minutes))
            is_mask = target.ne(PAD)
            if glance > 0:
                with torch.no_grad(), amp:
                    hidden = model(s, seq, key_limit=limit, return_hidden=True)
                    pred = torch.full_like(target, PAD)
                    pred[is_mask] = model.output_logits(hidden[is_mask]).argmax(-1)
                wrong = (pred.ne(target) & is_mask).sum(1).float()
                n_reveal = (wrong * glance).long()
                score = torch.rand(seq.shape, device=seq.device).masked_fill(~is_mask, 2.0)
                rank = score.argsort(1).argsort(1)
                reveal = (rank < n_reveal[:, None]) & is_mask
                seq = torch.where(reveal, target, seq)
                target = target.masked_fill(reveal, PAD)
                is_mask = target.ne(PAD)
            with amp:  # project only the scored masks: most positions are the prefix
                logits = model.output_logits(model(s, seq, key_limit=limit, return_hidden=True)[is_mask])
            loss, nll, n = ls_loss(logits, target[is_mask], a.label_smoothing)
            opt.zero_grad(set_to_none=True)
            (loss / max(n, 1)).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            win[0] += float(nll.detach())
            win[1] += n
            if step % a.log_interval == 0:
                log(f"drafter | update {step} | nll {win[0] / max(win[1], 1):.4f} | glance {glance:.2f} "
                    f"| tgt tok/s {win[1] / (time.time() - t_win):.0f} | {(time.time() - t0) / 60:.1f} min")
                t_win = time.time()
                win = [0.0, 0]
            if time.time() >= deadline:
                break
    meta = {"role": "nar-drafter", "mask_id": mask_id, "block_size": a.block_size, "verifier_sha": ver.sha,
            "updates": prior["updates"] + step, "minutes": round(prior["minutes"] + (time.time() - t0) / 60, 2),
            "recipe": " ".join(sys.argv)}
    if a.init_from:
        meta["init_from"] = {"path": str(a.init_from), **prior}
    checkpoint.save(out, model, tokenizer={"type": "sentencepiece", "src": "spm.model", "tgt": "spm.model"},
                    files={"spm.model": Path(a.verifier) / "spm.model"}, meta=meta)
    log(f"saved drafter to {out} after {step} updates")
    return out


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
    ap = argparse.ArgumentParser(prog="python -m aggdec.train.drafter", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["drafter", "heads"])
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--data", required=True, help="Seq-KD TSV (see aggdec.train.seqkd)")
    ap.add_argument("--src-col", default="src")
    ap.add_argument("--tgt-col", default="kd")
    ap.add_argument("--out", required=True)
    ap.add_argument("--block-size", type=int, default=10)
    ap.add_argument("--dec-layers", type=int, default=2)
    ap.add_argument("--init-from", default=None, help="drafter: continue training this drafter directory")
    ap.add_argument("--init-from-verifier", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--glance", type=float, default=0.5, help="initial glancing ratio (annealed to 0)")
    ap.add_argument("--hidden", type=int, default=512, help="heads: FFN width")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--max-minutes", type=float, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast for forward passes")
    ap.add_argument("--pad-multiple", type=int, default=8, help="round batch widths up to this (GPU shape reuse)")
    ap.add_argument("--log-interval", type=int, default=50)
    a = ap.parse_args(argv)
    if a.block_size < (2 if a.what == "heads" else 1):
        raise SystemExit("--block-size must be >= 2 for heads, >= 1 for a drafter")
    (train_heads if a.what == "heads" else train_drafter)(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The one batched draft -> verify loop shared by greedy, IAD, GAD, GAD++ and blockwise decoding.

Each iteration, for all active rows at once:
  1. Propose: the drafter returns a ragged draft per row (possibly empty).
  2. Verify: the verifier scores [last token ; draft] on top of each row's cached prefix, one call.
  3. Accept: the acceptance criterion returns, per row, the accepted draft length m and a bonus token.
  4. Commit: each row appends d_1..d_m + bonus; its cache keeps m + 1 of the fed positions (the rest
     is rolled back by not advancing its length).
     A double-token verifier (aggdec.double_token) emits a (head, tail) pair per step: it is fed its
     last pair, drafts and acceptance go by whole pairs and the bonus is a pair; its output is the
     unfolded stream.
  5. Observe: the drafter sees the accepted counts and the verifier state behind each bonus token.
  6. Retire and refill: rows that produced eos leave; free slots are refilled from the queue of
     pending sentences (continuous batching), encoded a batch at a time ahead of admission.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from aggdec.decoding.acceptance import (
    Acceptance,
    ExactMatch,
    VerifierScores,
    constrain_logits,
    unpack,
)
from aggdec.decoding.budget import DraftBudget
from aggdec.decoding.drafters import Drafter, NoDraft, Verified
from aggdec.decoding.metadata import DraftBatch, Hypothesis, Request, RowStats
from aggdec.decoding.state import NO_LIMIT, DecodeState
from aggdec.double_token import STRIDE, unfold
from aggdec.model import decode_attention
from aggdec.model.cache import CrossKV
from aggdec.model.projection import Constrain, OutputProjection
from aggdec.model.transformer import Transformer
from aggdec.threads import THREADS
from aggdec.thresholds import ENCODE_AHEAD, ENCODE_AHEAD_TOKENS


def pad_batch(seqs: list[list[int]], pad: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Right-pad int sequences into a (B, max_len) int64 tensor (width at least 1)."""
    width = max(1, max((len(s) for s in seqs), default=1))
    rows = [list(s) + [pad] * (width - len(s)) for s in seqs]  # one tensor call, not one a row
    out = torch.tensor(rows, dtype=torch.long) if rows else torch.full((0, width), pad, dtype=torch.long)
    return out.to(device)


def take(queue: list[Request], free_slots: int, used_tokens: int, max_tokens: int | None) -> list[Request]:
    """Pop up to `free_slots` requests off the end of `queue` (the longest, as queues are sorted by
    source length) while the active source tokens stay within `max_tokens`; an empty batch always
    takes one."""
    taken = []
    while queue and len(taken) < free_slots:
        n = len(queue[-1].src)
        if max_tokens is not None and used_tokens + n > max_tokens and (used_tokens or taken):
            break
        taken.append(queue.pop())
        used_tokens += n
    return taken


def ahead_count(longest: int) -> int:
    """Sentences encoded together by default where the longest has `longest` tokens: ENCODE_AHEAD,
    fewer where their padded tokens would pass ENCODE_AHEAD_TOKENS, at least 1."""
    return max(1, min(ENCODE_AHEAD, ENCODE_AHEAD_TOKENS // longest))


class EncodeAhead:
    """Cross K/V for refilled slots, encoded `batch` at a time ahead of admission (docs/design.md,
    "Encode-ahead refills"): a refill that was encoded ahead takes its rows; the others are encoded
    now together with the next pending requests of the queue, which then wait as cross K/V.
    `batch=None`: the loop's default, max_batch_size or `ahead_count`, whichever is more."""

    def __init__(self, model: Transformer, batch: int | None, counters: LoopCounters, max_batch_size: int):
        self.model, self.counters = model, counters
        self.batch, self.default = (max_batch_size, True) if batch is None else (batch, False)
        self.reset()

    def reset(self) -> None:
        self.cross: CrossKV | None = None  # cross K/V of pending requests encoded ahead of admission
        self.rows: dict[int, int] = {}  # id(request) -> its row in cross

    def place(self, reqs: list[Request], queue: list[Request], put: Callable[[list[int], CrossKV], None]) -> None:
        """Call put(indices into reqs, their cross K/V trimmed to their width), once or twice."""
        device = next(self.model.parameters()).device
        hit = [i for i, r in enumerate(reqs) if id(r) in self.rows]
        miss = [i for i, r in enumerate(reqs) if id(r) not in self.rows]
        if hit:
            rows = torch.tensor([self.rows.pop(id(reqs[i])) for i in hit], device=device)
            put(hit, self.cross.take(rows, trim=True))
        if miss:
            longest = max(len(reqs[i].src) for i in miss)  # the queue's are no longer
            count = max(self.batch, ahead_count(longest)) if self.default else self.batch
            ahead = queue[-1: -1 - max(0, count - len(miss)): -1]  # admitted next (pop order)
            batch = [reqs[i] for i in miss] + ahead
            memory, src_pad = self.model.encode(pad_batch([r.src for r in batch], self.model.cfg.pad, device))
            self.counters.encoded_rows += len(batch)
            cross = self.model.cross_kv(memory, src_pad)
            put(miss, cross.take(torch.arange(len(miss), device=device), trim=True))
            self.cross, self.rows = cross, {id(r): len(miss) + j for j, r in enumerate(ahead)}


def encoded_batches(model: Transformer, reqs: list[Request], max_batch_size: int
                    ) -> Iterator[tuple[int, list[Request], torch.Tensor, torch.Tensor]]:
    """Static batches of `reqs` (in order: beam search takes them longest first), `max_batch_size`
    at a time, with their encoder output: (index of the batch's first request, the batch, memory,
    src_pad), trimmed to the batch's longest source. Encoded whole batches at a time, as many as
    `ahead_count` allows (at least one), as the loops encode refills ahead."""
    device = next(model.parameters()).device
    at = 0
    while at < len(reqs):
        count = max(1, ahead_count(len(reqs[at].src)) // max_batch_size) * max_batch_size
        group = reqs[at: at + count]
        memory, src_pad = model.encode(pad_batch([r.src for r in group], model.cfg.pad, device))
        for off in range(0, len(group), max_batch_size):
            batch = group[off: off + max_batch_size]
            width = max(len(r.src) for r in batch)
            yield at + off, batch, memory[off: off + len(batch), :width], src_pad[off: off + len(batch), :width]
        at += len(group)


@dataclass
class LoopCounters:
    """Verifier work over a loop's runs. fed: real tokens scored (last token + draft per row);
    padded: tokens computed including padding to the longest draft (B * (K + 1) per call);
    captures, capture_failures: CUDA graphs captured, and captures that failed (those steps ran
    eagerly), by a captured slot loop."""

    calls: int = 0
    fed: int = 0
    padded: int = 0
    encoded_rows: int = 0
    captures: int = 0
    capture_failures: int = 0


class LoopBase:
    """What both loops (this one and `slot_loop.SlotLoop`) hold and how they admit requests: arguments
    as `DraftVerifyLoop`'s."""

    def __init__(self, model: Transformer, drafter: Drafter | None, acceptance: Acceptance | None, max_batch_size: int,
                 max_tokens: int | None, min_len: int, encode_batch: int | None, budget: DraftBudget | None,
                 prompt: tuple[int, ...] | None, projection: OutputProjection | None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model, self.drafter, self.acceptance = model, drafter or NoDraft(), acceptance or ExactMatch()
        self.max_batch_size, self.max_tokens, self.min_len, self.budget = max_batch_size, max_tokens, min_len, budget
        self.device = next(model.parameters()).device
        self.forced = torch.tensor(prompt[1:] if prompt else (), dtype=torch.long, device=self.device)
        self.stride = STRIDE if model.cfg.double_token else 1
        start = prompt[0] if prompt else model.cfg.eos
        self.starts = torch.tensor((model.cfg.bos, start) if self.stride > 1 else (start,), device=self.device)
        if self.stride > 1 and self.forced.numel():
            raise ValueError("a double-token model takes no forced first tokens")
        self.counters = LoopCounters()
        self._refills = EncodeAhead(model, encode_batch, self.counters, max_batch_size)
        self.projection = projection or OutputProjection(model.output_weight, certify=False, bias=model.output_bias,
                                                         int8=model.output_int8)

    def _queue(self, requests: Iterable[Request]) -> list[Request]:
        """The requests in admission order (pop() takes the longest); ValueError naming a request whose
        source or length limit the model cannot take."""
        cfg = self.model.cfg
        queue = sorted(requests, key=lambda r: len(r.src))
        for r in queue:
            if not 1 <= r.max_len < cfg.max_target_positions:
                raise ValueError(f"request {r.index}: max_len={r.max_len} outside [1, {cfg.max_target_positions - 1}]")
            if not 1 <= len(r.src) <= cfg.max_source_positions:
                raise ValueError(f"request {r.index}: source must have 1..{cfg.max_source_positions} tokens")
        return queue

    def _constrain(self, out_index: torch.Tensor, max_len: torch.Tensor) -> Constrain:
        """fairseq's rules for verified positions with these output indices and limits (`constrain_logits`),
        as `VerifierScores` takes them: on all of them, or on the positions `at`."""
        cfg = self.model.cfg

        def constrain(z: torch.Tensor, at: torch.Tensor | None) -> None:
            idx, lim = (out_index, max_len) if at is None else (out_index[at], max_len[at])
            constrain_logits(z, idx, lim, cfg.pad, cfg.eos, self.min_len, self.forced)
        return constrain


class DraftVerifyLoop(LoopBase):
    """Decode requests with `model` as verifier, `drafter` proposing and `acceptance` deciding.

    `max_batch_size` bounds the active rows; `max_tokens`, if set, bounds the sum of active source
    lengths (a row is always admitted into an empty batch). With `refill=False` the loop waits for
    the whole batch to finish before admitting more (static batching, for comparison).
    `projection` computes the verifier's top-1 and logits (default: plain fp32); one built with
    `certify=True` gives the certified bf16 top-1, which leaves every output unchanged.
    `encode_batch`: refills are encoded at least this many at a time (`EncodeAhead`; 0 or 1 encodes
    each refill alone).
    `budget`: chooses each call's draft length from measured costs and acceptance (DraftBudget);
    None verifies every drafted token.
    `prompt`: (decoder start token, forced first output tokens...), aggdec.conventions.Framing.prompt;
    default (eos,): fairseq's. A double-token model starts from the pair (bos, start) and takes no
    forced tokens.
    """

    def __init__(self, model: Transformer, drafter: Drafter | None = None, acceptance: Acceptance | None = None,
                 *, max_batch_size: int = 32, max_tokens: int | None = None, refill: bool = True, min_len: int = 1,
                 projection: OutputProjection | None = None, encode_batch: int | None = None,
                 budget: DraftBudget | None = None, prompt: tuple[int, ...] | None = None):
        super().__init__(model, drafter, acceptance, max_batch_size, max_tokens, min_len, encode_batch, budget, prompt,
                         projection)
        self.refill = refill
        # draft length of the next call
        self._length = NO_LIMIT if budget is None else budget.next_length(1, budget.max_length)
        if self.device.type == "cpu":  # loaded here, not in a call the draft budget times (a first build: 20 s)
            decode_attention.load()

    # -- admission -------------------------------------------------------------------------------

    def _take(self, queue: list[Request], free_slots: int, used_tokens: int) -> list[Request]:
        return take(queue, free_slots, used_tokens, self.max_tokens)

    def _new_state(self, reqs: list[Request]) -> DecodeState:
        cfg = self.model.cfg
        src = pad_batch([r.src for r in reqs], cfg.pad, self.device)
        cache = self.model.start(src, capacity=16)
        self.counters.encoded_rows += len(reqs)
        out = torch.full((len(reqs), 16), cfg.pad, dtype=torch.long, device=self.device)
        out[:, : self.stride] = self.starts
        return DecodeState(
            src=src,
            src_len=torch.tensor([len(r.src) for r in reqs], dtype=torch.long, device=self.device),
            out=out,
            out_len=torch.full((len(reqs),), self.stride, dtype=torch.long, device=self.device),
            max_len=torch.tensor([r.max_len for r in reqs], dtype=torch.long, device=self.device),
            cache=cache, requests=list(reqs), stats=[RowStats() for _ in reqs], pad=cfg.pad, eos=cfg.eos,
            budget=self._length, stride=self.stride,
        )

    def _fill(self, state: DecodeState, slots: list[int], reqs: list[Request], queue: list[Request]) -> None:
        """Place `reqs` into existing `slots` (same length): their cross K/V from those encoded ahead,
        the others encoded now together with the next `encode_batch` pending requests of `queue`."""
        cfg = self.model.cfg
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        self._refills.place(reqs, queue, lambda which, cross: state.cache.replace(idx[which], cross))
        src = pad_batch([r.src for r in reqs], cfg.pad, self.device)
        if src.shape[1] > state.src.shape[1]:
            state.src = torch.nn.functional.pad(state.src, (0, src.shape[1] - state.src.shape[1]), value=cfg.pad)
        state.src[idx] = torch.nn.functional.pad(src, (0, state.src.shape[1] - src.shape[1]), value=cfg.pad)
        state.src_len[idx] = torch.tensor([len(r.src) for r in reqs], dtype=torch.long, device=self.device)
        state.out[idx] = cfg.pad
        state.out[idx, : self.stride] = self.starts
        state.out_len[idx] = self.stride
        state.max_len[idx] = torch.tensor([r.max_len for r in reqs], dtype=torch.long, device=self.device)
        for s, r in zip(slots, reqs):
            state.requests[s] = r
            state.stats[s] = RowStats()
        self.drafter.admit(state, idx)

    # -- the loop --------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, requests: Iterable[Request]) -> Iterator[Hypothesis]:
        """Yield one Hypothesis per request, in completion order (use `.index` to restore order).

        Pending requests are admitted longest first, so refilled rows never widen the batch's
        source padding.
        """
        cfg = self.model.cfg
        s = self.stride
        queue = self._queue(requests)
        self._refills.reset()
        THREADS.start()
        state: DecodeState | None = None
        observed = 0.0  # seconds of the last call's observe: drafting for the next call
        while queue or state is not None:
            if state is None:
                state = self._new_state(self._take(queue, self.max_batch_size, 0))
                self.drafter.admit(state, torch.arange(state.batch_size, device=self.device))
            t0 = time.perf_counter()
            # 1. Propose.
            draft = self.drafter.propose(state)
            plain = draft.tokens.shape[1] == 0
            if plain:  # nothing drafted: steps 2-4 at a width of 0
                fed_hidden, done = self._plain_step(state)
                accepted = torch.zeros_like(state.out_len)
                padded = state.batch_size
            else:
                room = (state.max_len - state.generated).clamp(min=0)  # positions past max_len never accepted
                num_draft = torch.minimum(draft.num_draft, room).clamp(max=state.budget)
                num_draft = num_draft - num_draft % s  # whole steps only
                # 2. Verify: [last step ; draft] for every row in one call; project only real positions.
                block = torch.cat([state.last_step(), draft.tokens], dim=1)  # (B, K+S)
                k1 = block.shape[1]
                offs = torch.arange(k1, device=self.device)[None]
                valid = offs < num_draft[:, None] + s  # (B, K+S)
                hidden = self.model.decode_hidden(block, state.cache, valid=valid)  # (N, D), packed
                out_index = (state.generated[:, None] + offs).expand_as(valid)[valid]
                max_len = state.max_len[:, None].expand_as(valid)[valid]
                scores = VerifierScores(self.projection, hidden, self._constrain(out_index, max_len))
                # 3. Accept.
                accepted, bonus = self.acceptance.accept(draft.tokens, num_draft, scores, valid)
                bonus = bonus[:, None]  # (B, S)
                if s > 1:  # whole pairs; the bonus pair is the verifier's top-1 at m, m + 1
                    accepted = accepted - accepted % s
                    steps = accepted[:, None] + torch.arange(s, device=self.device)[None]
                    bonus = unpack(scores.top1, valid, cfg.pad).gather(1, steps)
                # 4. Commit d_1..d_m + bonus; truncate after the step that holds eos.
                drafted = torch.nn.functional.pad(draft.tokens, (0, s), value=cfg.pad)  # (B, K+S)
                fill = bonus if s == 1 else bonus.gather(1, (offs - accepted[:, None]).clamp(0, s - 1))
                new = torch.where(offs < accepted[:, None], drafted, fill)
                is_eos = (new == cfg.eos) & (offs < accepted[:, None] + s)
                done = is_eos.any(dim=1)
                n_new = torch.where(done, (is_eos.long().argmax(dim=1) // s + 1) * s, accepted + s)
                state.reserve_out(k1)
                rows = torch.arange(state.batch_size, device=self.device)[:, None].expand(-1, k1)
                state.out[rows, state.out_len[:, None] + offs] = new
                state.out_len = state.out_len + n_new
                state.cache.commit(accepted + s)
                n_fed = valid.sum(dim=1)
                fed_hidden = hidden[torch.cumsum(n_fed, 0) - n_fed + accepted]  # each row's last verified state
                padded = block.numel()
            # The call's seconds: this iteration up to here and the drafting done for it in the last
            # one's observe (at this call's length); encoding refills (the same per sentence whatever
            # the draft length) left out. The budget hears them before it picks the next length, so a
            # challenger block of one call runs one call.
            seconds = time.perf_counter() - t0 + observed
            if self.budget is not None:
                tokens, offered = ((state.batch_size * s, 0) if plain
                                   else torch.stack([n_new.sum(), draft.num_draft.max()]).tolist())
                self.budget.record(self._length, tokens, seconds, state.batch_size, offered=offered)
                self._length = self.budget.next_length(state.batch_size, self.budget.max_length)
                state.budget = self._length
            # 5. Observe.
            t0 = time.perf_counter()
            checked = draft if plain else DraftBatch(draft.tokens, num_draft)
            self.drafter.observe(state, checked, accepted, Verified(fed_hidden, state.cache.layer_keys))
            observed = time.perf_counter() - t0
            # Drafts accepted past an accepted eos are dropped: count only the committed ones.
            if plain:
                zeros = [0] * state.batch_size
                self._record(state, zeros, zeros, seconds)
            else:
                self._record(state, num_draft.tolist(), torch.minimum(accepted, n_new).tolist(), seconds)
            self.counters.calls += 1
            self.counters.padded += padded
            THREADS.tick()
            # 6. Retire finished rows, refill their slots.
            done_list = done.tolist()
            if any(done_list):
                state = yield from self._retire(state, done_list, queue)
        self._refills.reset()

    def _plain_step(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 2-4 of a call in which no row drafts (greedy, or drafting turned off): each row's
        top-1 step (a double-token model's: its pair) after its last one, committed. The tokens and
        statistics of the general step at a width of 0 (every rule accepts nothing there and takes
        the top-1), with about half its operators. Returns (each row's state at its first position
        (B, D), which rows ended (B,))."""
        s = self.stride
        hidden = self.model.decode_hidden(state.last_step(), state.cache).flatten(0, 1)  # (B*S, D)
        if s == 1:
            at, out_index, max_len = state.out_len[:, None], state.generated, state.max_len
        else:
            offs = torch.arange(s, device=self.device)
            at = state.out_len[:, None] + offs
            out_index, max_len = (state.generated[:, None] + offs).flatten(), state.max_len.repeat_interleave(s)
        step = VerifierScores(self.projection, hidden, self._constrain(out_index, max_len)).top1.view(-1, s)
        state.reserve_out(s)
        state.out.scatter_(1, at, step)
        state.out_len = state.out_len + s
        state.cache.commit(s)
        return hidden[::s], (step == self.model.cfg.eos).any(dim=1)

    def _record(self, state: DecodeState, nd: list[int], acc: list[int], seconds: float) -> None:
        """Each row's statistics after a call that offered it nd[b] draft tokens, acc[b] of them kept."""
        fed = sum(nd) + self.stride * len(nd)
        self.counters.fed += fed
        for st, d, a in zip(state.stats, nd, acc):
            st.iterations += 1
            st.drafted += d
            st.accepted += a
            st.accepted_per_iter.append(a)
            st.decode_ms += 1000.0 * seconds * (d + self.stride) / fed

    def _retire(self, state: DecodeState, done: list[bool], queue: list[Request]):
        out_len = state.out_len.tolist()
        finished = [i for i, d in enumerate(done) if d]
        for i in finished:
            stream = state.out[i, self.stride : out_len[i]].tolist()  # without the start
            toks = stream[:-1] if self.stride == 1 else unfold(stream, self.model.cfg.eos)  # without eos
            yield Hypothesis(index=state.requests[i].index, tokens=toks, stats=state.stats[i])
        used = sum(len(r.src) for i, r in enumerate(state.requests) if not done[i])
        reqs = self._take(queue, len(finished), used) if self.refill else []
        if reqs:
            self._fill(state, finished[: len(reqs)], reqs, queue)
            finished = finished[len(reqs):]
        if finished:
            gone = set(finished)
            keep = [i for i in range(state.batch_size) if i not in gone]
            if not keep:
                return None
            rows = torch.tensor(keep, dtype=torch.long, device=self.device)
            state.select(rows)
            self.drafter.select(rows)
        state.cache.trim_cross()
        return state

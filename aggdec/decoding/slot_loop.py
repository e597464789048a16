"""The decode loop: every draft -> verify method (greedy, IAD, GAD, GAD++, blockwise, double-token)
runs here, on fixed batch slots with their bookkeeping on the device (docs/design.md, "The slot loop").
Each iteration, for every slot at once: the drafter proposes (slots, width) draft tokens; the verifier
scores [last step ; draft] on each slot's cached prefix as one flat batch of tokens (`slots.Tokens`);
the acceptance rule gives each row's accepted length m and bonus; each row commits d_1..d_m + bonus; the
drafter observes (a `from_states` one after the draft budget's choice); finished rows retire and their
slots take pending requests (continuous batching). The host reads one small tensor a step (`_summary`).
Outputs are greedy's under exact top-1, whatever the backend, slot count and refill order.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Iterable, Iterator

import torch

from aggdec.decoding.acceptance import Acceptance, ExactMatch, VerifierScores
from aggdec.decoding.budget import DraftBudget
from aggdec.decoding import compiled_step
from aggdec.decoding.capture_check import CaptureError, checked
from aggdec.decoding.drafters import NoDraft, Verified
from aggdec.decoding.metadata import DraftBatch, Hypothesis, Request, RowStats
from aggdec.decoding.scheduler import EncodeAhead, LoopCounters, take
from aggdec.decoding.state import DecodeState
from aggdec.double_token import STRIDE, unfold
from aggdec.model import decode_attention
from aggdec.model import invariant as batch_invariant
from aggdec.model.precision import refuse_int8
from aggdec.model.projection import OutputProjection, Rules
from aggdec.model.slots import SlotCache, Tokens, capacity, exact_span, leading
from aggdec.model.transformer import Transformer
from aggdec.threads import THREADS
from aggdec.thresholds import DRAFT_LONGEST, GRAPH_MIN_SLOTS, GRAPH_WIDTHS, SLOT_POSITIONS

STATE_ROWS = ("src", "src_len", "out", "out_len", "max_len", "index")
"""The fields of `DecodeState` that hold a row per slot (narrowed and moved with the slots)."""

ADMISSION = 5
"""Columns of an admitted row before its source (`SlotLoop._admission`): slot, source length, length limit,
row in the cross K/V encoded ahead, request index."""


def slot_count(rows: int) -> int:
    """The power of two at or above `rows` (at least 1): a loop's slots for max_batch_size rows, and
    the slots a run of fewer requests, or a run's tail, runs on."""
    return 1 << (max(rows, 1) - 1).bit_length()


def capture_plan(slots: int, max_draft: int, fewest: int) -> list[tuple[int, int]]:
    """The (slots, width) of every step a captured loop over `slots` slots can take, largest first: the
    slot counts a run narrows to (halving down to `fewest`), the widths 0, `max_draft` and the
    `GRAPH_WIDTHS` below it. A captured step reads the whole cache and source width, so neither is a
    dimension of the plan."""
    counts = [slots] + [n for n in (slots >> i for i in range(1, slots.bit_length())) if n >= fewest]
    widths = sorted({0, max_draft, *(w for w in GRAPH_WIDTHS if w < max_draft)}, reverse=True)
    return [(n, w) for n in counts for w in widths]


class SlotLoop:
    """Decode requests with `model` as verifier, `drafter` proposing (default: none, greedy) and
    `acceptance` deciding (default: exact top-1), on fixed slots (module docstring).

    `max_batch_size` bounds the active rows and sizes the slots (allocated at the first run and kept:
    later runs of any size reuse them, `release` frees them); `max_tokens`, if set, bounds the sum of active source
    lengths (a row is always admitted into an empty batch). With `refill=False` the loop waits for
    the whole batch to finish before admitting more (static batching, for comparison).
    `projection` computes an eager step's top-1 and logits (default: plain fp32); one built with
    `certify=True` gives the certified bf16 top-1, which leaves every output unchanged.
    `encode_batch`: refills are encoded at least this many at a time (`EncodeAhead`; 0 or 1 encodes
    each refill alone). `budget`: chooses each call's draft length from measured costs and acceptance
    (DraftBudget); None verifies every drafted token. `prompt`: (decoder start token, forced first
    output tokens...), aggdec.conventions.Framing.prompt; default (eos,): fairseq's. A double-token
    model starts from the pair (bos, start) and takes no forced tokens.
    `graphs`: capture the fixed-shape steps as CUDA graphs (default: on a CUDA device; every step of
    `capture_plan`, once for the loop's buffers), or "check": run each step, admission and retirement
    eagerly under a replayed graph's rules (`capture_check`, any device). `compile` (CPU; not an int8
    verifier): the whole fixed-shape step compiled through `torch.export` and AOTInductor, stored once per
    machine (aggdec.decoding.compiled_step); `use_compiled` changes it between runs, on the same slots.
    Elsewhere steps run eagerly (`eager`), on the live tokens alone where the CPU kernel attends
    (`Transformer.decode_slots`). `invariant`: encode and step within `invariant.kernels()` (aggdec.model.invariant:
    every row's states the same whatever the batch; CUDA, or a CPU under Triton's interpreter; eager or
    captured, not compiled); ValueError where the kernels cannot run.
    An int8 verifier on a CUDA device is refused (ValueError, `precision.refuse_int8`)."""

    def __init__(self, model: Transformer, drafter=None, acceptance: Acceptance | None = None, *,
                 max_batch_size: int = 32, max_tokens: int | None = None, min_len: int = 1,
                 encode_batch: int | None = None, budget: DraftBudget | None = None,
                 prompt: tuple[int, ...] | None = None, graphs: bool | str | None = None, compile: bool | str = False,
                 projection: OutputProjection | None = None, refill: bool = True, invariant: bool = False):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model, self.drafter, self.acceptance = model, drafter or NoDraft(), acceptance or ExactMatch()
        self.max_batch_size, self.max_tokens, self.min_len, self.budget = max_batch_size, max_tokens, min_len, budget
        self.device = next(model.parameters()).device
        if model.output_int8 is not None:
            refuse_int8(self.device)
        self.invariant = invariant
        if invariant and (why := batch_invariant.unavailable(self.device, next(model.parameters()).dtype) or (
                model.output_int8 is not None and "an int8 verifier has no invariant kernels")):
            raise ValueError(f"invariant: {why}")
        self.forced = torch.tensor(prompt[1:] if prompt else (), dtype=torch.long, device=self.device)
        self.stride = STRIDE if model.cfg.double_token else 1
        start = prompt[0] if prompt else model.cfg.eos
        self.starts = torch.tensor((model.cfg.bos, start) if self.stride > 1 else (start,), device=self.device)
        if self.stride > 1 and self.forced.numel():
            raise ValueError("a double-token model takes no forced first tokens")
        self.counters = LoopCounters()
        self._refills = EncodeAhead(model, encode_batch, self.counters, max_batch_size)
        self.dtype, self.refill = next(model.parameters()).dtype, refill
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        # a half-precision model's CPU cache holds fp32 keys and values (docs/design.md, "Slots and buffers")
        kernel = self.device.type == "cpu" and decode_attention.load()
        self.cache_dtype = torch.float32 if kernel and self.dtype in (torch.bfloat16, torch.float16) else self.dtype
        # a kernel attends each token through row maps: the CPU's for the cache's dtype, or the invariant one
        self._kernel = kernel and self.cache_dtype in (torch.float32, torch.float64) or invariant
        # fixed-shape steps read no host: a certified projection's plain fp32 twin (the same token)
        plain = OutputProjection(model.output_weight, certify=False, bias=model.output_bias, int8=model.output_int8)
        self._projections = (projection or plain, plain if projection is None or projection.certify else projection)
        self.max_draft = DRAFT_LONGEST if self.drafter.max_draft is None else self.drafter.max_draft
        self._after = self.drafter.from_states  # drafts from each call's verifier states, after the step
        self._source_bound = getattr(self.drafter, "source_bound", False)  # optional (`Drafter`)
        self.states: tuple[torch.Tensor, torch.Tensor] | None = None  # the last step's (hidden, accepted)
        self.compiled: compiled_step.CompiledStep | None = None  # built by the first compiled run
        self._failed: str | None = None  # why compiling failed, once it did: the loop stays eager
        self.release()  # no slot buffers (`_allocate`) nor graphs yet
        self.use_compiled(compile, stacklevel=3)

    def use_compiled(self, compile: bool, stacklevel: int = 2) -> None:
        """Whether the next runs' steps are compiled (`compile`: CPU; an int8 verifier, or a loop whose compile
        failed, warns and decodes eagerly), on the loop's own slots: the choice may change between runs."""
        if compile not in (False, True):
            raise ValueError(f"compile must be True or False, got {compile!r}")
        if compile and self.device.type != "cpu":
            raise ValueError("compile is for CPU decoding (on a GPU, steps are captured as CUDA graphs)")
        if compile and (why := compiled_step.refused(self.model) or self._failed
                        or (self.invariant and "the invariant kernels run eagerly")):
            warnings.warn(f"aggdec: compile: {why}; decoding eagerly", stacklevel=stacklevel)
            compile = False
        self.compile = compile
        # eager steps may read the host (`projection`), and where the kernel attends, take the live tokens alone
        self.eager = not compile and self.graphs is False
        self._live_tokens = self.eager and self._kernel
        self.projection = self._projections[0 if self.eager else 1]
        # slots a run narrows to at least (a compiled step specializes a batch of 1)
        self._fewest = GRAPH_MIN_SLOTS if self.graphs else 2 if compile else 1
        if compile and self.compiled is None:
            self.compiled = compiled_step.CompiledStep(self)

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

    # -- the step: one fixed-shape program -------------------------------------------------------

    def step(self, width: int, span: int, src_width: int) -> None:
        """One iteration for every slot, in place; writes self._summary (done flags, output lengths,
        committed tokens, fed tokens, the longest draft offered before the cut at `width`)."""
        st, cfg, s, active = self.state, self.model.cfg, self.stride, self.active
        generated = st.generated
        if width:
            draft = self.drafter.propose(st, width)
            drafts = draft.tokens
            room = (st.max_len - generated).clamp(min=0, max=width)
            num = torch.where(active, torch.minimum(draft.num_draft, room), 0)
            num = num - num % s if s > 1 else num  # whole steps only
            offered = torch.where(active, draft.num_draft, 0).max()[None]
            block = torch.cat([st.last_step(), drafts], dim=1)  # (B, T)
        else:
            block = st.last_step()
        # 2. Verify [last step ; draft] as one flat batch of tokens: the live slots' real positions
        # (`_live_tokens`), else every position of every slot
        b, t = block.shape
        offs = torch.arange(t, device=self.device)[None]
        keep = None
        if self._live_tokens:
            keep = (offs < num[:, None] + s) & active[:, None] if width else active[:, None].expand(b, t)
        tokens = Tokens.of(block, generated, keep)
        hidden = self.model.decode_slots(tokens, self.cache, span, src_width)
        scores = VerifierScores(self.projection, hidden, Rules(tokens.pos, st.max_len[tokens.rows], cfg.pad, cfg.eos,
                                                                self.min_len, self.forced))
        # 3. Accept (no draft: every rule takes the top-1), 4. commit d_1..d_m + bonus; cut after the step that
        # holds an eos. A double-token verifier keeps whole pairs, its bonus pair the top-1 at m, m + 1.
        if width:
            accepted, bonus = self.acceptance.accept(drafts, num, scores, tokens)
            accepted, bonus = ((accepted - accepted % s, tokens.grid(scores.top1, cfg.pad)) if s > 1
                               else (accepted, bonus[:, None]))
            new = torch.where(offs < accepted[:, None], torch.nn.functional.pad(drafts, (0, s), value=cfg.pad), bonus)
            is_eos = (new == cfg.eos) & (offs < accepted[:, None] + s)
            ended = is_eos.any(dim=1)
            n_new = torch.where(ended, (is_eos.long().argmax(dim=1) // s + 1) * s, accepted + s) * active
        else:
            accepted = torch.zeros_like(st.out_len) if self._after else None  # (read by state drafters only)
            new = tokens.grid(scores.top1, cfg.pad)
            ended, n_new = (new == cfg.eos).any(dim=1), active.long() if s == 1 else active.long() * s
        # writes in place by index_put_ (compiled, a scatter_ into a buffer copies all of it)
        rows = torch.arange(st.out.shape[0], device=self.device)
        at = (st.out_len[:, None] + offs).clamp(max=st.out.shape[1] - 1)
        st.out.index_put_((rows[:, None], at), new)  # an empty slot's writes are never read: a refill resets its row
        st.out_len.add_(n_new)
        # statistics (a refill zeroes its row's): drafts accepted past an accepted eos are not counted
        fed = (num + s) * active if width else n_new
        self.ms.addcmul_(self.fed_before, self.ms_per_fed)
        self.fed_before.copy_(fed)
        if width:
            kept = torch.minimum(accepted, n_new)
            self.hist.index_put_((rows, self.iterations.clamp(max=self.hist.shape[1] - 1)), kept.int())
            self.drafted.add_(num)
            self.accepted.add_(kept)
        self.iterations.add_(active.long())
        done = ended & active
        active ^= done  # (done: live slots only)
        # 5. Observe (a drafter that drafts from the call's states does so after the budget's choice: `run`).
        if width and not self._after:
            self.drafter.observe(st, DraftBatch(drafts, num), accepted, None)
        if self._after:  # each slot's state behind its bonus token (an empty slot's: any)
            at = tokens.grid(torch.arange(hidden.shape[0], device=self.device), 0).gather(1, accepted[:, None])
            self.states = (hidden[at[:, 0]], accepted)
        total = n_new.sum(0, keepdim=True)
        self._summary.copy_(torch.cat([done.long(), st.out_len, total, fed.sum(0, keepdim=True) if width else total,
                                       offered if width else self._zero]))

    def _observe_states(self, span: int, src_width: int, length: int) -> None:
        """A `from_states` drafter drafts the next call from the last step's states at each slot's last
        verified position, once the loop knows the next call drafts (eager, whatever runs the step)."""
        behind, accepted = self.states
        keys = functools.partial(self.cache.layer_keys, lengths=self.state.generated, span=span, src_width=src_width)
        self.drafter.observe(self.state, None, accepted, Verified(behind, keys, length))

    def _run_step(self, width: int, span: int, src_width: int) -> None:
        if self.compile:
            try:
                self.compiled(width, span, src_width)
                return
            except compiled_step.CompileFailed as e:  # before a program ran: rerun eagerly
                warnings.warn(f"aggdec: compiling the decoder step failed, decoding eagerly: {e}", stacklevel=2)
                self._failed, self.compiled = f"compiling failed ({e})", None
                self.use_compiled(False)
        key = (self.state.batch_size, width)
        if self.graphs == "check":
            if key not in self._plan or (span, src_width) != (self.cache.length - 1, self.cache.src_width - 1):
                raise CaptureError(f"step {key} reading {span} positions and {src_width} source positions is not "
                                   "in the capture plan (the whole cache): a captured run would capture it")
            checked(lambda: self.step(width, span, src_width), self, "states", host_data=False)
            return
        graph = self._captured.get(key) if self.graphs else None
        if graph is None:  # eager; captured: a step whose capture failed (counted)
            self.step(width, span, src_width)
            return
        graph.replay()
        if self._after:  # the replayed graph's own output buffers
            self.states = self._graph_states[key]

    def _capture_plan(self) -> None:
        """Capture every step of `capture_plan` not captured yet (a run reusing the loop's buffers
        reuses their graphs), largest first: each slot count's steps on the narrowed slots, then all
        slots again. A step whose capture fails is counted (`LoopCounters.capture_failures`) and runs
        eagerly; the state is as it was either way."""
        whole = self._whole_state.batch_size
        failed = []
        for key in self._plan:
            if key in self._captured:
                continue
            self._narrow(key[0])
            try:
                self._capture(key)
            except RuntimeError as e:
                self._captured[key] = None
                failed.append(f"{key}: {e}")
        self._narrow(whole)
        self.counters.capture_failures += len(failed)
        if failed:
            warnings.warn(f"aggdec: {len(failed)} CUDA graph capture(s) failed, those steps run eagerly; first: "
                          f"{failed[0]}", stacklevel=3)

    def _capture(self, key: tuple[int, int]) -> None:
        """Capture the step for `key` (slots, width), reading the whole cache, on the model's device, after
        one warm-up run whose effects are undone, also where the warm-up or the capture raises (an eager
        retry then runs the step once)."""
        mutable = [self.state.out, self.state.out_len, *self._whole_rows.values(), *self._whole_drafter.values()]
        saved = [t.clone() for t in mutable]
        with torch.cuda.device(self.device):
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                whole = (key[1], self.cache.length - 1, self.cache.src_width - 1)
                with torch.cuda.stream(side):
                    self.step(*whole)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    self.step(*whole)
            finally:
                for t, s in zip(mutable, saved):
                    t.copy_(s)
        self._pool = graph.pool()
        self._captured[key] = graph
        self.counters.captures += 1
        if self._after:
            self._graph_states[key] = self.states

    # -- slots -----------------------------------------------------------------------------------

    def _allocate(self, requests: list[Request]) -> None:
        """The loop's slot buffers for a run of `requests`: those it holds, reset in place, where their
        cache is long and wide enough (captured steps stay valid); else new ones, at least twice as long
        or wide (`slots.capacity`), counted in `LoopCounters.allocations`. Always `slot_count(max_batch_size)`
        slots: a run of fewer requests narrows to its own (`run`)."""
        cfg = self.model.cfg
        # one position more than any span or width reads, so a compiled step's shapes stay symbolic
        need = max(r.max_len for r in requests) + self.max_draft + 2 + self.stride
        need_src = max(len(r.src) for r in requests)
        cache = self._whole_cache
        if cache is not None and cache.length - 1 >= need and cache.src_width - 1 >= need_src:
            self._reset()
            return
        longest = cfg.max_target_positions + self.max_draft + 2 + self.stride  # what any request may need
        length = min(capacity(need, SLOT_POSITIONS), capacity(longest, SLOT_POSITIONS)) + 1
        src_width = min(capacity(need_src, SLOT_POSITIONS), capacity(cfg.max_source_positions, SLOT_POSITIONS)) + 1
        if cache is not None:  # grown: never shorter or narrower than before
            length, src_width = max(length, cache.length), max(src_width, cache.src_width)
        b, dev = slot_count(self.max_batch_size), self.device
        self.release()  # the old buffers go before the new ones are made
        self.counters.allocations += 1
        self.cache = SlotCache(cfg.dec_layers, cfg.inner_dim(cfg.dec_heads), b, length, src_width, self.cache_dtype,
                               dev)
        long = functools.partial(torch.zeros, dtype=torch.long, device=dev)  # rows `_reset` fills
        self.state = DecodeState(
            src=torch.full((b, src_width), cfg.pad, dtype=torch.long, device=dev), src_len=long(b),
            out=long(b, length), out_len=long(b), max_len=long(b), cache=self.cache, requests=[None] * b,
            pad=cfg.pad, eos=cfg.eos, stride=self.stride, index=long(b))
        # on CUDA, a refill batch's `_admission` rows in pinned host memory and on the device
        self._pinned = self._admitted = None
        if dev.type == "cuda":
            self._admitted = torch.empty((b, ADMISSION + src_width), dtype=torch.long, device=dev)
            self._pinned = torch.empty_like(self._admitted, device="cpu").pin_memory()
        self._whole_rows = {"active": torch.zeros(b, dtype=torch.bool, device=dev), "iterations": long(b),
                            "drafted": long(b), "accepted": long(b),
                            "hist": torch.zeros(b, length, dtype=torch.int32, device=dev),
                            "ms": torch.zeros(b, dtype=torch.float64, device=dev),
                            "fed_before": torch.zeros(b, dtype=torch.float64, device=dev)}
        self.ms_per_fed = torch.zeros((), dtype=torch.float64, device=dev)
        self._zero, self._whole_summary = long(1), long(2 * b + 3)
        self._whole_state, self._whole_cache, self._whole_drafter = self.state, self.cache, {}
        self._plan = capture_plan(b, self.max_draft, self._fewest)
        self._widths = sorted({w for _, w in self._plan})  # once, not per call
        self._reset()

    def release(self) -> None:
        """Free the slot buffers and the CUDA graphs captured on them; a compiled step stays. The next run
        allocates anew (and captures anew)."""
        self.cache = self.state = self._whole_cache = self._whole_state = None
        self._whole_rows, self._whole_drafter, self._captured, self._graph_states, self._pool = {}, {}, {}, {}, None

    def _narrow(self, n: int) -> None:
        """Run the next steps on the first `n` slots: every per-slot tensor (the state's, the cache's, the
        statistics', the drafter's) becomes its first n rows (`slots.leading`, sharing its storage)."""
        whole = self._whole_state
        self.cache = self._whole_cache.narrow(n)
        self.state = dataclasses.replace(whole, cache=self.cache,
                                         **{name: leading(getattr(whole, name), n) for name in STATE_ROWS})
        for name, t in self._whole_rows.items():
            setattr(self, name, leading(t, n))
        for name, t in self._whole_drafter.items():
            setattr(self.drafter.rows, name, leading(t, n))
        self._summary = leading(self._whole_summary, 2 * n + 3)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every tensor the step reads or writes but the model's and the loop's constants (`forced`, `starts`,
        `_zero`), by name, as the loop holds them now (narrowed): a compiled step's inputs
        (aggdec.decoding.compiled_step)."""
        found = {f"state.{name}": getattr(self.state, name) for name in STATE_ROWS}
        found |= {f"cache.{i}": t for i, t in enumerate(self.cache.tensors())}
        found |= {f"rows.{name}": getattr(self, name) for name in self._whole_rows}
        found |= {f"drafter.{name}": t for name, t in self.drafter.rows.tensors().items()}
        return found | {"summary": self._summary, "ms_per_fed": self.ms_per_fed}

    def bind(self, buffers: dict[str, torch.Tensor]) -> None:
        """Hold `buffers` (named as `buffers` names them) in their places."""
        self.cache = SlotCache.of([t for name, t in buffers.items() if name.startswith("cache.")])
        self.state = dataclasses.replace(self.state, cache=self.cache,
                                         **{name: buffers[f"state.{name}"] for name in STATE_ROWS})
        for name in self._whole_rows:
            setattr(self, name, buffers[f"rows.{name}"])
        for name in self.drafter.rows.tensors():
            setattr(self.drafter.rows, name, buffers[f"drafter.{name}"])
        self._summary, self.ms_per_fed = buffers["summary"], buffers["ms_per_fed"]

    def _compact(self, live: list[int], n: int) -> list[int]:
        """Move the rows of the `live` slots into the first `n` slots and narrow to them, so that a run's
        tail computes no empty slots past them; returns each live row's slot, in `live`'s order."""
        taken = set(live)
        movers = [s for s in live if s >= n]
        holes = [s for s in range(n) if s not in taken][: len(movers)]
        if movers:
            st = self._whole_state
            src, dst = torch.tensor([movers, holes], device=self.device)  # one copy
            for t in (*(getattr(st, name) for name in STATE_ROWS), *self._whole_cache.tensors(),
                      *self._whole_rows.values(), *self._whole_drafter.values()):
                t[dst] = t[src]
            for m, h in zip(movers, holes):
                st.requests[h], st.requests[m] = st.requests[m], None
        self._narrow(n)
        where = dict(zip(movers, holes))
        return [where.get(s, s) for s in live]

    def _reset(self) -> None:
        """Every slot empty; tensors keep their storage (captured steps stay valid), the drafter's too:
        its rows are its whole tensors again (a tail may have narrowed them), admitted in place."""
        self._narrow(self._whole_state.batch_size)
        for t in (self.state.src_len, self.state.max_len):
            t.fill_(1)
        self.active.zero_()
        self._fresh(torch.arange(self.state.batch_size, device=self.device))
        if self.max_draft:
            self._whole_drafter = self.drafter.rows.tensors()

    def _fill(self, slots: list[int], reqs: list[Request], queue: list[Request]) -> None:
        """Place `reqs` into free `slots`: their rows packed on the host and copied at once (`_admission`),
        cross K/V from those encoded ahead or encoded now with the next `encode_batch` pending requests
        (`scheduler.EncodeAhead`, the encoder's own pass), then fresh rows in place on the device (`_admit`,
        under a replay's rules in check mode)."""
        st = self.state
        reqs, rows, ahead = self._refills.take(reqs)
        width, hit = st.src.shape[1], len(rows)
        admitted = self._admission([[s, len(r.src), r.max_len, a, r.index, *r.src, *[st.pad] * (width - len(r.src))]
                                    for s, r, a in zip(slots, reqs, rows + [0] * (len(reqs) - hit))])
        fresh = self._refills.encode(reqs[hit:], queue)
        for s, r in zip(slots, reqs):
            st.requests[s] = r
        widest = max((len(r.src) for r in reqs[:hit]), default=0)
        admit = functools.partial(self._admit, admitted, hit, ahead, widest, fresh)
        checked(admit, self, host_data=False) if self.graphs == "check" else admit()

    def _admission(self, rows: list[list[int]]) -> torch.Tensor:
        """`rows` (int64, `ADMISSION` columns and a source each) on the device: one tensor built on the host,
        one copy (on CUDA through pinned memory, not waited for: the next admission comes after a step's
        read of its summary, which waits for the copy)."""
        host = torch.tensor(rows, dtype=torch.long)
        if self._pinned is None:
            return host.to(self.device)
        pinned, admitted = self._pinned[: len(rows)], self._admitted[: len(rows)]
        pinned.copy_(host)
        return admitted.copy_(pinned, non_blocking=True)

    def _admit(self, admitted: torch.Tensor, hit: int, ahead, widest: int, fresh) -> None:
        """Fresh rows for the refills of `admitted` (`_admission`'s rows): cross K/V, the first `hit` from
        `ahead` (`widest` source positions), the others `fresh`; source, limits, outputs, statistics and the
        drafter's rows, in place, with no host read."""
        st = self.state
        idx = admitted[:, 0].contiguous()
        if hit:
            self.cache.place(idx[:hit], ahead.take(admitted[:hit, 3].contiguous(), width=widest))
        if fresh is not None:
            self.cache.place(idx[hit:], fresh)
        st.src.index_copy_(0, idx, admitted[:, ADMISSION:])
        for t, column in ((st.src_len, 1), (st.max_len, 2), (st.index, 4)):
            t.index_copy_(0, idx, admitted[:, column])
        self.active.index_fill_(0, idx, True)
        self._fresh(idx)

    def _fresh(self, idx: torch.Tensor) -> None:
        """The rows `idx`: outputs at the start tokens, statistics zero, the drafter's rows admitted."""
        st = self.state
        st.out.index_fill_(0, idx, st.pad)
        st.out[:, : self.stride].index_copy_(0, idx, self.starts.expand(idx.shape[0], -1))
        st.out_len.index_fill_(0, idx, self.stride)
        for t in (self.iterations, self.drafted, self.accepted, self.hist, self.ms, self.fed_before):
            t.index_fill_(0, idx, 0)
        if self.max_draft:
            self.drafter.admit(st, idx)

    def _retire(self, slots: list[int], out_len: list[int]) -> Iterator[Hypothesis]:
        """Read the finished rows once (one tensor, gathered on the device from the step's done flags,
        under a replay's rules in check mode) and yield their hypotheses."""
        width = max(out_len[s] for s in slots)
        gather = functools.partial(self._retired, len(slots), width)
        values = (checked(gather, self, host_data=False) if self.graphs == "check" else gather()).tolist()
        n = width - self.stride  # output columns; a row's iterations are at most its tokens
        for j, s in enumerate(slots):
            row = [int(v) for v in values[j][: 2 * n + 3]]
            out, hist, (iters, drafted, accepted) = row[:n], row[n: 2 * n], row[2 * n:]
            stats = RowStats(iterations=iters, drafted=drafted, accepted=accepted, accepted_per_iter=hist[:iters],
                             decode_ms=values[j][-1])
            tokens = unfold(out, self.model.cfg.eos) if self.stride > 1 else out[: out_len[s] - 2]  # no eos
            yield Hypothesis(index=self.state.requests[s].index, tokens=tokens, stats=stats)
            self.state.requests[s] = None

    def _retired(self, count: int, width: int) -> torch.Tensor:
        """(count, ...) float64: the `count` finished slots' rows, in slot order (the done flags of the step's
        summary sorted, no host index): outputs without the start up to `width`, accepted per call, iterations,
        drafted, accepted, decode time (ms; the last call's share added here, the step adds each call's share
        at the next one)."""
        n = self.state.batch_size
        rows = torch.argsort(self._summary[:n], descending=True, stable=True)[:count]
        ms = self.ms + self.fed_before * self.ms_per_fed
        counts = torch.stack([self.iterations, self.drafted, self.accepted], dim=1)
        return torch.cat([self.state.out[rows, self.stride: width].double(),
                          self.hist[rows, : width - self.stride].double(), counts[rows].double(), ms[rows, None]],
                         dim=1)

    # -- the loop --------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, requests: Iterable[Request]) -> Iterator[Hypothesis]:
        """Yield one Hypothesis per request, in completion order (use `.index` to restore order);
        pending requests are admitted longest first."""
        queue = self._queue(requests)
        if not queue:
            return
        self._allocate(queue)
        if self.graphs is True:
            with batch_invariant.kernels(self.invariant):
                self._capture_plan()
        self._refills.reset()
        THREADS.start()
        # the slots the steps run on: the power of two that holds the requests (all slots where they
        # fill them) until the queue is empty
        n = min(self.state.batch_size, max(self._fewest, slot_count(len(queue))))
        self._narrow(n)
        free = list(range(n))
        src_len = [0] * n  # host copy of each occupied slot's source length
        out_len = [self.stride] * n
        length = self.max_draft if self.budget is None else self.budget.next_length(1, self.max_draft)
        observed = 0.0  # seconds of the last call's drafting from states: drafting for this call
        while queue or len(free) < n:
            if free and queue and (self.refill or len(free) == n):
                reqs = take(queue, len(free), sum(src_len), self.max_tokens)
                if reqs:
                    slots, free = free[: len(reqs)], free[len(reqs):]
                    with batch_invariant.kernels(self.invariant):
                        self._fill(slots, reqs, queue)
                    for s, r in zip(slots, reqs):
                        src_len[s], out_len[s] = len(r.src), self.stride
            t0 = time.perf_counter()
            live = [s for s in range(n) if src_len[s]]
            if self.graphs:  # the captured shapes (`capture_plan`), reading the whole cache
                src_width, span = self.cache.src_width - 1, self.cache.length - 1
                width = max(w for w in self._widths if w <= length)
            else:  # eager, or compiled with symbolic shapes: the exact sizes, no padding read
                src_width = exact_span(max(src_len), self.cache.src_width - 1)
                # no draft copied from the source is longer than it (other drafters' keep their length)
                width = min(length, src_width) if self._source_bound else length
                width = 2 if width == 1 and self.compile else width  # (compiled_step: sizes 0 and 1 are fixed)
                span = exact_span(max(out_len[s] for s in live) + width, self.cache.length - 1)
            built = self.compiled and self.compiled.seconds
            with batch_invariant.kernels(self.invariant):
                self._run_step(width, span, src_width)
            built = built != (self.compiled and self.compiled.seconds)  # this call built or loaded a program
            summary = self._summary.tolist()  # the one host read of the iteration
            done, out_len = summary[:n], summary[n: 2 * n]
            tokens, fed, offered = summary[2 * n: 2 * n + 3]
            if self.graphs and width < length:  # drafts cut at a captured width: longer ones are untried
                offered = min(offered, width)
            seconds = time.perf_counter() - t0 + observed
            self.ms_per_fed.fill_(1000.0 * seconds / max(fed, 1))
            self.counters.calls += 1
            self.counters.fed += fed
            if not self.compile:  # a compiled program's thread count stays (its parallel loops are built for it)
                THREADS.tick()
            self.counters.padded += n * (width + self.stride)
            if self.budget is not None and self.max_draft:
                if not built:  # a program's build (seconds, once) is no cost of the length that met it
                    plain = len(live) * self.stride  # what a call without drafts commits and verifies
                    self.budget.record(length, tokens, seconds, len(live), offered=offered,
                                       drafted=max(fed - plain, 0), accepted=max(tokens - plain, 0))
                length = self.budget.next_length(len(live), self.max_draft)
            observed = 0.0
            if self._after and length:  # the next call drafts: from this call's states
                t0 = time.perf_counter()
                self._observe_states(span, src_width, length)
                observed = time.perf_counter() - t0
            finished = [s for s in range(n) if done[s]]
            if finished:
                yield from self._retire(finished, out_len)
                for s in finished:
                    src_len[s] = 0
                free = sorted(free + finished)
                live = [s for s in range(n) if src_len[s]]
                # the tail, half the slots or more empty: the power of two that holds the live rows (`_fewest`
                # at least)
                fewer = max(self._fewest, slot_count(len(live))) if live else n
                if not queue and fewer < n:
                    placed = dict(zip(self._compact(live, fewer), live))  # new slot -> old
                    n = self.state.batch_size
                    src_len = [src_len[placed[s]] if s in placed else 0 for s in range(n)]
                    out_len = [out_len[placed[s]] if s in placed else self.stride for s in range(n)]
                    free = [s for s in range(n) if s not in placed]
        self._refills.reset()

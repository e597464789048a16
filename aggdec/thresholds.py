"""Every size threshold that picks which code path decodes, and every other tuning constant of
aggdec/decoding and aggdec/model (with the API's default chunk), in one place (docs/design.md, "What
runs where"), each with the reason for its value. The thresholds were measured on 2-core x86 CPUs
(AVX-512 VNNI, AVX2); none changes an output: the paths on either side of a threshold compute the
same tokens (beam search's chunked candidates up to the order of exactly equal values).
"""

ENCODE_AHEAD = 32
"""Sentences a refill is encoded with at least, by default, at any batch size (fewer where they
would exceed ENCODE_AHEAD_TOKENS): at batch 1 a sentence encoded alone streams all the encoder's
weights from memory for its 20-odd tokens (gec-base: 12.6 MB), 32 sentences share one pass
(docs/design.md, "Encode-ahead refills")."""

ENCODE_AHEAD_TOKENS = 4096
"""Source tokens (padded to the longest) that ENCODE_AHEAD's sentences may reach: what waits as
cross K/V beyond the batch stays small for long sentences and large models."""

MATCH_DEPTH = 16
"""Longest output suffix a fixed-shape re-alignment tries (`InputCopy.match`)."""

TOP1_ROWS = 128
"""Positions per product in the plain top-1: their (n, V) logits stay in the cache, where one product
over every position of a large batch (1,300 positions x 8,000 tokens x 4 bytes: 42 MB) is written to
fresh pages at every call (glibc maps allocations over 32 MB anew) and read again by the argmax."""

AUTO_CERTIFIED_ROWS = 64
"""Positions from which a call takes the certified top-1 under `verify_precision = "auto"` (fewer
take fp32's). The bf16 product's saving grows with the positions a call computes, while what the
bound leaves to refine from fp32 logits does not shrink with them: on a CPU with AMX the certified
top-1 pays from about 64 positions on every shipped model (with AVX512-BF16 alone: 1.09x greedy at 64 on
gec-base and ende-base, a 2-core AMD EPYC), and costs below that where many positions need their candidates' fp32 logits (docs/design.md, "Certified bf16 top-1")."""

MIN_MACS = 1 << 20
"""Products with an unpacked weight and fewer multiply-adds (rows x in x out) stay on `F.linear`."""

WIDE_ROW_MACS = 1 << 17
"""A prepacked weight (`packed_for`) with at least this many multiply-adds per row (in x out: the
256x768 fused q/k/v, 256x1024, 1024x256, the output projection) is used from 2 rows; any from
`MIN_MACS` multiply-adds in all, as unpacked ones. Packing once removes the per-call reorder that made small
products slower on oneDNN; a wide product then beats MKL from 2 rows, a 256x256 one only from about
16 rows."""

CPP_GEMM_SLOTS = 8
"""Slots up to which a compiled fp32 step's products are TorchInductor's C++ GEMM template on weights
packed once, inlined into the program (at a few rows it beats a library call); with more slots ATen's
products, which freezing turns into oneDNN's on prepacked weights (faster than the template on wide
products, the output projection first; docs/design.md, "The slot loop"). One backend
per program, so no timing chooses between kernels and a run's arithmetic is the same every time;
float64 (test) models always take ATen's."""

GRAPH_MIN_SLOTS = 32
"""Slots a captured run's tail narrows to at least (`slot_loop.capture_plan`): on a GPU a step over
fewer rows is bound by its kernel launches, not its rows, so narrowing further would save nothing and
add graphs to capture at start (a CUDA device's figure: not measured yet, the GPU check's to confirm)."""

SLOT_POSITIONS = 64
"""Positions a loop's slot buffers hold at least, both the self-attention length and the source width
(`slots.capacity`: powers of two from here). A short first call still gets buffers that later calls of
ordinary sentences fit, so a loop allocates once for them (64 slots of gec-base: 32 MB of keys and values
at this floor); a longer sentence doubles them (to at most the model's limit)."""

REDUCE_CHUNK = 64
"""Logits a chunk holds in `projection.top2`, the eager top-1 and top-2 over fp32 rows: at 64 x 8,000
logits on a 2-core AVX-512 CPU, 89 us for the first maximal index against 461 us for max(dim) (32: 118 us,
16: 640 us, as slow as max, whose cost the chunks' maxima then repeat), 104 us for the top two against
623 us for topk(2); from CHUNKED_FROM logits (at 1 x 8,000: 28 us against 10 us)."""

CHUNKED_FROM = 32768
"""Elements from which top_candidates and `projection.top2` search chunks: below, torch.topk's or max's one
pass costs less than the chunked search's five operators, whose fixed cost only many logits repay."""


# -- decoding (aggdec/decoding): the slot loop, its kept loops, streams, the draft budget, IAD, beam --

GRAPH_WIDTHS = (1, 2, 4, 8, 16, 32, 64)
"""Draft widths a captured run verifies (with 0 and the drafter's longest draft; `slot_loop.capture_plan`):
the draft budget's length is rounded down to one of them, which verifies fewer draft tokens and changes no
output."""

KEPT_BUDGETS = 16
"""Draft budgets a DraftContext keeps (one per distinct options, least recently used dropped first)."""

KEPT_LOOPS = 8
"""Slot loops a DraftContext keeps (one per distinct options and compile choice, least recently used
dropped first), for their compiled steps: options used in turn compile once each, not at every switch."""

KEPT_BUFFERS = 4
"""Distinct options whose kept loops also keep their slot buffers (and CUDA graphs) between calls, the
most recently used; older loops release theirs (`SlotLoop.release`). Options used in turn (greedy then
IAD and back, a call's streams and its single loop) then allocate and capture once each, while what
the loops hold stays bounded: 4 x max_batch_size slots of cache (64 slots of a gec-base-sized model
at 256 positions: about 100 MB each)."""

COMPILE_COLD_S = 26.0
"""Seconds `compile = "auto"` counts for building a loop's step where the store does not hold it yet
(aggdec.step_store), until this machine measured it: a one-sentence `aggdec decode --compile` of
`gec-base` greedy took 22.8 s cold against 2.0 s eager on a 2-core AMD EPYC."""

COMPILE_WARM_S = 1.5
"""Seconds it counts where the store holds the step (importing TorchInductor and loading the package),
until this machine measured it: the same decode took 3.9-4.1 s warm against 2.0 s eager (AMD EPYC). Where
a loop of the same options compiled in this process already, it counts none."""

GREEDY_COMPILE_SAVES_S = 0.012
"""Seconds greedy's compiled step saved a sentence at batch size 1: `ende-base`, 54-57 against 33
sentences/s eager (1/33 - 1/55 s). A compiled step saves about a fixed time a verifier call (the host
work and operators it fuses), and a call at batch size b serves b rows, so `auto` counts b times less a
sentence there (`compile_choice.compile_pays`: at 64, 0.0002 s, where 1.1x of 307 sentences/s saved 0.0003 s: on
the safe side). Compiling then pays from COMPILE_COLD_S / 0.012 = about 2,200 sentences a slot (requests /
batch size) where the store is cold, COMPILE_WARM_S / 0.012 = 125 where it is warm: at batch size 1,
2,200 and 125 sentences; at 64, 140,000 and 8,000. One sentence saves 0.012 s: it decodes eagerly."""

IAD_COMPILE_SAVES_S = 0.002
"""IAD's at batch size 1: `gec-base`, 114 sentences/s eager, compiled 1.3x (1/114 - 1/148 s; its 4-5 calls
a sentence save less than greedy's 25-odd): it pays from about 13,000 sentences a slot cold, 750 warm."""

RATE_REQUESTS = 16
"""Requests (and at least a batch) from which a call's seconds a request are recorded for `compile = "auto"`
(`compile_choice.record`): fewer measure mostly a call's fixed costs."""

DRAFTER_COMPILE_SAVES_S = 0.005
"""GAD's, GAD++'s and blockwise's at batch size 1: on a 2-core AMD EPYC, `ende-base` GAD (draft head) ran
21.7 sentences/s eager and 40.1 compiled, blockwise (proposal heads) 15.9 and 28.7, saving 0.021 and
0.028 s a sentence where greedy saved 0.045 s; scaled as greedy's 0.012 s (an AMX Xeon) to it, about
0.005 s. Compiled they were also 1.06x and 1.15x eager at 64 (so no `auto_below`). Where a machine
measured both (`compile_choice.record`), its own rates count instead."""

MIN_STREAM_BATCH = 16
"""The fewest rows a stream decodes at once (`max_batch_size // streams`) and the fewest requests it
takes: below, one loop on all threads (`streams.stream_count`)."""

DRAFT_LONGEST = 64
"""The draft budget's `max_length` for drafters without a limit of their own (IAD without a draft cap),
and the longest draft a slot loop verifies for them."""

DRAFT_EXPLORE = 20
"""After a challenger lost, the draft budget's next one waits until best-length blocks have run this many
times the seconds it lost (its block's time less that of its tokens at the choice's rate), so trials
cost at most about 1/DRAFT_EXPLORE of a run: on a wide batch one call drafting the longest length costs
tens of greedy calls, and trials of it at a fixed interval would cost a large share of a long run."""

DRAFT_PROBE = 64
"""Draft tokens a cold draft budget's first trial verifies a call at most, over the rows of its widest call so
far (64 a row at batch 1, 2 at 32, 1 from 64 rows): its call verifies at most 64 positions more than a greedy
call. A first trial of up to 4,096 tokens a call (64 a row up to 64 rows) verified 2,080 positions a call at
batch 32, 65 times a greedy call's, on a 74M model whose drafts never land (the 2-token trial: 60 ms, greedy 26)."""

DRAFT_RAMP = 4
"""How fast drafting grows where drafts land (at least `DRAFT_LANDED` of their tokens accepted; `DraftBudget`):
a longer length that took over is challenged next by this many times it (2, 8, 32, 64 tokens a row at batch 32),
and a trial from none that landed but lost narrowly (a cost a drafting call pays once, which longer drafts
share) is tried next this many times as long."""

DRAFT_LANDED = 0.5
"""The share of a block's drafted tokens accepted from which its drafts count as landing (`DRAFT_RAMP`)."""

DRAFT_EVIDENCE = 4
"""Rows a drafting challenger of none drafts over (the rows of its calls that drafted), none of its tokens
accepted, before it is judged lost without the rest of its block: four calls at batch 1, where one
rejected draft (a copying model's edit at the draft's first token) does not end its trial; one call on
four rows or more."""

DRAFT_WARM = 2
"""The draft budget's blocks are a quarter as long until this many comparisons were judged: a cold start
finds out quickly what clearly does not pay."""

IAD_MIN_DRAFT = 4
"""The shortest per-row draft cap of IAD's adaptive caps (`InputCopy(adaptive=True)`), which halve after a
draft rejected early: one- and two-token drafts cost a verifier call's positions for little gain."""

CHUNKS = range(256, 63, -16)
"""Chunk lengths beam search's `top_candidates` may cut rows into, the longest dividing the vocabulary
first: whole vectors of 16 floats (lengths that are not reduced several times slower on the CPU)."""

# -- the model (aggdec/model) and the API --

REFINE_WIDTH = 16
"""Most candidates `OutputProjection.top1` refines from the fp32 weight rows before it recomputes a
whole fp32 row."""

CHUNK_SIZE = 1024
"""Sentences `Translator.translate_iterable` decodes at a time by default: enough for the loop's slots to
stay full (refills) and the encoder to run ahead, few enough that results stream."""

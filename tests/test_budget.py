"""DraftBudget settles on the draft length with the most output tokens per measured second."""

import numpy as np
import torch

from aggdec.decoding.budget import DraftBudget
from aggdec.thresholds import DRAFT_EVIDENCE, DRAFT_PROBE


def _drive(budget: DraftBudget, rows: int, accept, cost, calls: int = 200) -> list[int]:
    """Run `calls` simulated calls: accept(L) -> accepted per row, cost(rows, drafted) -> seconds."""
    chosen = []
    length = budget.next_length(rows, budget.max_length)
    for _ in range(calls):
        nd = torch.full((rows,), length)
        acc = torch.minimum(nd, accept(length, rows))
        budget.record(length, int((acc + 1).sum()), cost(rows, int(nd.sum())), drafted=int(nd.sum()),
                      accepted=int(acc.sum()))
        length = budget.next_length(rows, budget.max_length)
        chosen.append(budget.choice)
    return chosen


def test_cheap_drafts_are_drafted_in_full():
    """Batch-1-like costs (a fixed cost per call dominates) and good drafts: the longest draft."""
    budget = DraftBudget(6)
    chosen = _drive(budget, 1, lambda length, rows: torch.full((rows,), length), lambda b, d: 1e-3 + 1e-5 * (b + d))
    assert chosen[-50:] == [6] * 50


def test_drafting_turns_itself_off_where_it_does_not_pay():
    """Compute-bound costs (every token costs as much as the call) and poor drafts: greedy steps."""
    budget = DraftBudget(4)
    gen = torch.Generator().manual_seed(0)

    def accept(length, rows):  # each position kept with probability 0.3, given the previous one was
        return (torch.rand(rows, length, generator=gen) < 0.3).long().cumprod(1).sum(1) if length else torch.zeros(
            rows, dtype=torch.long)

    chosen = _drive(budget, 64, accept, lambda b, d: 1e-4 * (b + d))
    assert chosen[-50:] == [0] * 50
    assert budget.score and all(s < 0 for s in budget.score.values())  # each length tried lost


def test_a_budget_counts_the_calls_that_drafted_and_says_why():
    """Every recorded call is counted, those at a draft length above 0 apart; `describe` names the choice
    and what each length tried against it measured."""
    budget = DraftBudget(4)
    assert budget.describe() == "no draft, nothing measured against it yet"
    gen = torch.Generator().manual_seed(0)
    _drive(budget, 64, lambda length, rows: (torch.rand(rows, length, generator=gen) < 0.3).long().cumprod(1).sum(1)
           if length else torch.zeros(rows, dtype=torch.long), lambda b, d: 1e-4 * (b + d))
    assert budget.calls == 200 and 0 < budget.drafting_calls < 40
    why = budget.describe()
    assert why.startswith("no draft; ") and all(f"{x} token" in why for x in budget.score), why
    assert all(f"{np.exp(s):.2f}x its output tokens/s" in why for s in budget.score.values()), why


def test_a_cold_budget_starts_on_the_plain_path_and_retries_a_dropped_comparison():
    """A cold budget's first block is greedy; its first challenger one token a row. A batch that
    shrinks right after that challenger's block drops the comparison (a kept budget's warm-up run
    drains so): the same challenger is tried again next, and where drafting loses greedy stays chosen."""
    budget = DraftBudget(4, row_calls=16 * 64)  # blocks of 16 calls (4 while warm) at 64 rows
    gen = torch.Generator().manual_seed(0)
    lengths, length = [], budget.next_length(64, 4)
    for call in range(60):  # compute-bound costs, poor drafts: greedy pays
        lengths.append(length)
        rows = 40 if 8 <= call < 12 else 64
        acc = (torch.rand(rows, length, generator=gen) < 0.3).long().cumprod(1).sum(1) if length else torch.zeros(rows)
        budget.record(length, int((acc + 1).sum()), 1e-4 * rows * (1 + length), rows)
        length = budget.next_length(rows, 4)
    assert lengths[:4] == [0] * 4 and lengths[4:8] == [1] * 4  # greedy, then one token a row
    assert lengths[8:16] == [0] * 8  # the comparison dropped by the shrink
    assert lengths[16:20] == [1] * 4  # the same challenger again
    assert budget.choice == 0 and set(budget.score) == {1}


def test_lengths_that_draft_alike_do_not_keep_none_from_being_tried():
    """IAD-like drafts of at most 20 tokens: at 64, the step down (48) drafts the same tokens and its
    comparisons are dropped. It is set aside, not tried again and again as still untried, so greedy
    keeps being tried: once drafting stops paying (its tokens cost 40x more from call 400), greedy
    is chosen."""
    budget = DraftBudget(64)
    length, chosen = budget.next_length(1, 64), []
    for call in range(3000):
        drafted = min(length, 20)
        per_token = 5e-5 if call < 400 else 2e-3
        budget.record(length, drafted + 1, 1e-3 + per_token * drafted, 1, offered=20, drafted=drafted,
                      accepted=drafted)
        length = budget.next_length(1, 64)
        chosen.append(budget.choice)
    assert 64 in chosen[300:400]  # long drafts paid first
    assert chosen[-100:] == [0] * 100


def test_a_wide_batch_finds_out_in_few_calls():
    """At 128 rows a call averages over many rows: blocks are short, so a bulk run of a few hundred
    calls where drafting does not pay drafts in few of them (16-call blocks draft in about 20)."""
    budget = DraftBudget(4)
    gen = torch.Generator().manual_seed(0)
    lengths, length = [], budget.next_length(128, 4)
    for _ in range(360):
        lengths.append(length)
        acc = (torch.rand(128, length, generator=gen) < 0.3).long().cumprod(1).sum(1) if length else torch.zeros(128)
        budget.record(length, int((acc + 1).sum()), 1e-4 * 128 * (1 + length), 128)
        length = budget.next_length(128, 4)
    assert budget.choice == 0 and lengths[-20:] == [0] * 20
    assert sum(length > 0 for length in lengths) <= 12


def test_a_middle_length_when_later_positions_are_poor():
    """Positions 1-2 nearly always kept, 3-6 never; a per-token cost: two tokens are worth it, more are not."""
    budget = DraftBudget(6)
    chosen = _drive(budget, 16, lambda length, rows: torch.full((rows,), min(length, 2)),
                    lambda b, d: 2e-3 + 1e-4 * (b + d), calls=1500)
    assert chosen[-50:] == [2] * 50


def test_a_translator_keeps_the_budgets_of_its_recent_options(tiny_model_dir):
    from aggdec.api import Translator
    from aggdec.decoding.methods import KEPT_BUDGETS

    tr = Translator.load(tiny_model_dir)
    for b in range(KEPT_BUDGETS + 4):
        tr.translate_batch(["The cat ."], method="iad", max_len_b=10 + b)
    assert len(tr._budgets) == KEPT_BUDGETS
    assert [o.max_len_b for o, _, _ in tr._budgets] == list(range(14, 14 + KEPT_BUDGETS))  # oldest first


def test_lengths_that_draft_alike_are_not_compared_on_noise():
    """IAD-like: drafts end with the source (at most 20 tokens offered) and are all accepted, under
    noisy timing. Lengths from 20 up draft the same tokens: they are never judged against each other
    (noise would decide), so once chosen the length never walks down to where drafts are cut."""
    gen = torch.Generator().manual_seed(1)

    def run(informed: bool) -> tuple[DraftBudget, list[int], list[int]]:
        budget = DraftBudget(64)
        lengths, chosen, length = [], [], budget.next_length(1, 64)
        for _ in range(3000):
            offered = int(torch.randint(4, 21, (1,), generator=gen))
            drafted = min(length, offered)
            noise = float(torch.empty(1).uniform_(0.5, 1.5, generator=gen))
            seconds = noise * (1e-3 + 5e-5 * drafted)
            budget.record(length, drafted + 1, seconds, 1, offered=offered if informed else None,
                          drafted=drafted, accepted=drafted)
            lengths.append(length)
            chosen.append(budget.choice)
            length = budget.next_length(1, 64)
        return budget, lengths, chosen

    budget, lengths, chosen = run(informed=True)
    assert all(c < 20 for c in budget.score)  # only shorter lengths were judged against the choice
    long = next(i for i, n in enumerate(chosen) if n >= 20)
    assert min(n for n in lengths[long + 1:] if n) >= 20  # once chosen long, no draft was cut again
    blind, _, _ = run(informed=False)
    assert any(c >= 20 for c in blind.score)  # without what was offered, equal lengths were judged


def test_from_none_the_last_drafting_length_is_tried_again():
    """A start where drafting lost (here: its calls were slow; on a machine, noise in a cold start's
    short blocks) leaves greedy chosen; once long drafts pay and one token still does not (a fixed
    cost per drafted call), none's challengers include the length chosen before it, so drafting
    comes back, and at full length."""
    budget = DraftBudget(8)
    calls = 0

    def cost(rows, drafted):
        slow = 20.0 if calls < 40 else 1.0  # drafting calls were slow at first
        return 1e-3 + (1e-3 * slow + 1e-5 * drafted if drafted else 0.0)

    length, chosen = budget.next_length(16, 8), []
    for calls in range(4000):
        accepted = torch.full((16,), length)
        budget.record(length, int((accepted + 1).sum()), cost(16, 16 * length), 16, drafted=16 * length,
                      accepted=16 * length)
        length = budget.next_length(16, 8)
        chosen.append(budget.choice)
    assert 0 in chosen[:60] and chosen[-50:] == [8] * 50


def test_a_cold_budget_probes_few_positions_and_ramps_where_drafts_land():
    """From a cold start on none the first drafting challenger drafts DRAFT_PROBE tokens over the rows: 64 a
    row at 1 row, 1 at 256. Where every draft lands and pays (a fixed cost per call), each length that takes
    over is challenged by four times it: 1, 4, 16, 64 tokens a row within a few blocks. Where none lands, the
    trial ends once it drafted over DRAFT_EVIDENCE rows, and none stays chosen."""
    for rows, ramp in ((1, [64]), (256, [1, 4, 16, 64])):
        budget = DraftBudget(64)
        lengths, length = [], budget.next_length(rows, 64)
        for _ in range(60):
            lengths.append(length)
            budget.record(length, rows * (1 + length), 1e-3 * (1 + 0.01 * length), rows, offered=100,
                          drafted=rows * length, accepted=rows * length)
            length = budget.next_length(rows, 64)
        assert ramp[0] == max(1, DRAFT_PROBE // rows)
        assert list(dict.fromkeys(lengths))[:len(ramp) + 1] == [0, *ramp] and budget.choice == 64, lengths
        assert lengths.index(64) <= 16
        budget, lengths = DraftBudget(64), []
        length = budget.next_length(rows, 64)
        for _ in range(40):
            lengths.append(length)
            budget.record(length, rows, 1e-3 * (1 + 0.5 * length), rows, offered=100, drafted=rows * length,
                          accepted=0)
            length = budget.next_length(rows, 64)
        assert set(lengths) == {0, ramp[0]} and budget.choice == 0
        first = lengths.index(ramp[0])  # the trial: the calls that draft over EVIDENCE rows
        calls = -(-DRAFT_EVIDENCE // rows)
        assert lengths[first: first + calls + 1] == [ramp[0]] * calls + [0]


def test_trials_that_lose_cost_a_small_share_of_a_run():
    """256 rows, compute-bound calls (every fed token costs the same) and drafts accepted three times
    in ten: drafting loses by about half. Trials of it wait for EXPLORE times the time they lost, so
    over a long run they take about 1/EXPLORE of its time (here 4.9%; with the gap of 32 two-call
    blocks alone, 13%: a trial at 16 tokens a row costs 17 greedy calls' time)."""
    budget = DraftBudget(64)
    gen = torch.Generator().manual_seed(0)
    spent = {True: 0.0, False: 0.0}
    length = budget.next_length(256, 64)
    for _ in range(4000):
        acc = (torch.rand(256, length, generator=gen) < 0.3).long().cumprod(1).sum(1) if length else torch.zeros(256)
        seconds = 4e-5 * 256 * (1 + length)
        spent[length > 0] += seconds
        budget.record(length, int((acc + 1).sum()), seconds, 256, offered=length)
        length = budget.next_length(256, 64)
    assert budget.choice == 0
    assert spent[True] < 0.06 * (spent[True] + spent[False])


def test_a_challenger_that_offered_no_draft_is_not_judged_against_none():
    """From none, a drafting challenger whose calls were offered no draft (IAD between its rows' starts) ran
    as greedy does: its block is not judged (timing noise would decide), so drafting is not chosen by it."""
    budget = DraftBudget(16)
    gen = torch.Generator().manual_seed(3)
    length, chosen = budget.next_length(8, 16), []
    for _ in range(400):
        noise = float(torch.empty(1).uniform_(0.7, 1.3, generator=gen))
        budget.record(length, 8, noise * 1e-3, 8, offered=0)  # one token a row, whatever the length
        length = budget.next_length(8, 16)
        chosen.append(budget.choice)
    assert set(chosen) == {0} and not budget.score


def test_drafts_that_never_land_are_turned_off_at_a_large_models_cost(monkeypatch):
    """IAD with the draft budget on a model whose outputs never copy its input (no draft is ever accepted),
    its calls costing what a large model's compute-bound calls cost (each verified position as much as a
    greedy step's; a clock the loop reads): once the budget has settled (the second half of the run),
    at most a tenth of the calls draft, and the drafted tokens are a small share of the output's."""
    import random
    import types

    from tiny_models import tiny_model

    from aggdec.decoding import slot_loop
    from aggdec.decoding.iad import InputCopy
    from aggdec.decoding.metadata import Request

    model = tiny_model("prenorm-learned-separate", seed=5, vocab=13, output_bias=True)
    alphabet = [4, 5, 6]  # sources of tokens the model never outputs: a copy of the input is never accepted
    with torch.no_grad():
        model.decoder.output_bias[alphabet] = -1e4
    rng = random.Random(1)
    reqs = [Request(index=i, src=[rng.choice(alphabet) for _ in range(rng.randint(4, 12))] + [model.cfg.eos],
                    max_len=24) for i in range(400)]
    now = [0.0]
    monkeypatch.setattr(slot_loop, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    run_step, calls = slot_loop.SlotLoop._run_step, []

    def charged(self, width, span, src_width):  # 1 ms per verified position of every slot
        run_step(self, width, span, src_width)
        now[0] += 1e-3 * self.state.batch_size * (1 + width)
        calls.append(width)

    monkeypatch.setattr(slot_loop.SlotLoop, "_run_step", charged)
    loop = slot_loop.SlotLoop(model, InputCopy(), max_batch_size=8, budget=DraftBudget(16))
    hyps = list(loop.run(reqs))
    assert sum(h.stats.accepted for h in hyps) == 0
    settled = calls[len(calls) // 2:]
    assert sum(w > 0 for w in settled) <= 0.1 * len(settled), settled  # (every call drafts without the budget)
    assert sum(h.stats.drafted for h in hyps) <= 0.05 * sum(len(h.tokens) for h in hyps)

"""The method registry: a new drafter is one options class + one drafter class + one `register` call,
with the loop untouched; options are declared once and the signature covers every one of them."""

import dataclasses
import random
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_model

from aggdec.api import Translator, decode_options
from aggdec.decoding.drafters import NoDraft, RowState
from aggdec.decoding.metadata import DraftBatch, Request
from aggdec.decoding.options import output_options
from aggdec.decoding.methods import METHODS, DraftContext, Method, register, unregister
from aggdec.decoding.options import DecodeOptions, OptionError, option
from aggdec.model.projection import OutputProjection


@dataclass(frozen=True, kw_only=True)
class LookupOptions(DecodeOptions):
    method: ClassVar[str] = "lookup"

    ngram: int = option(1, "Match the output's last `ngram` tokens in the output so far.", low=1)
    width: int = option(3, "Draft tokens per call.", low=1)


class LookupDrafter:
    """A toy n-gram lookup drafter: where the output's last `ngram` tokens occurred before in the
    output, propose the `width` tokens that followed them (the most recent occurrence)."""

    name = "lookup"
    from_states = False  # drafts from the output, not from the verifier's states

    def __init__(self, ngram: int, width: int):
        self.ngram, self.width = ngram, width
        self.max_draft = width
        self.rows = RowState()

    @classmethod
    def from_options(cls, opts: LookupOptions, ctx: DraftContext) -> "LookupDrafter":
        return cls(opts.ngram, opts.width)

    def admit(self, state, slots):
        self.rows.admit(state, slots, proposals=0)

    def propose(self, state, width):  # reads the host: the eager loop takes it
        drafts = []
        for b in range(state.batch_size):
            out = state.out[b, : int(state.out_len[b])].tolist()
            key, found = out[-self.ngram:], []
            for start in range(len(out) - self.ngram - 1, -1, -1):
                if out[start: start + self.ngram] == key:
                    found = out[start + self.ngram: start + self.ngram + min(self.width, width)]
                    break
            drafts.append(found)
        k = max(map(len, drafts), default=0)
        tokens = torch.full((state.batch_size, k), state.pad, dtype=torch.long)
        for b, d in enumerate(drafts):
            tokens[b, : len(d)] = torch.tensor(d, dtype=torch.long)
        num = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        self.rows.proposals = self.rows.proposals + (num > 0).long()
        return DraftBatch(tokens=tokens, num_draft=num)

    def observe(self, state, draft, accepted, hidden):
        pass


@pytest.fixture
def lookup_method():
    method = register(Method(LookupOptions, LookupDrafter.from_options))
    try:
        yield method
    finally:
        unregister("lookup")


def _requests(rng, n, vocab, eos):
    reqs = []
    for i in range(n):
        src = [rng.choice([4, 5, 6, rng.randrange(4, vocab)]) for _ in range(rng.randint(0, 12))] + [eos]
        reqs.append(Request(index=i, src=src, max_len=rng.randint(1, 30)))
    return reqs


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), bs=st.integers(1, 6), ngram=st.integers(1, 3), width=st.integers(1, 5))
def test_a_registered_drafter_is_lossless(seed, bs, ngram, width):
    method = register(Method(LookupOptions, LookupDrafter.from_options))
    try:
        model = tiny_model("postnorm-sinusoidal-shared", vocab=8)
        rng = random.Random(seed)
        reqs = _requests(rng, rng.randint(1, 9), model.cfg.src_vocab, model.cfg.eos)
        rng.shuffle(reqs)
        ctx = DraftContext(model, OutputProjection(model.output_weight, certify=False), False, lambda p, b: None)
        greedy = METHODS["greedy"].decode(decode_options("greedy", max_batch_size=3), reqs, ctx)
        opts = decode_options("lookup", ngram=ngram, width=width, max_batch_size=bs)
        lookup = method.decode(opts, reqs, ctx)
        assert {h.index: h.tokens for h in lookup} == {h.index: h.tokens for h in greedy}
        assert method.lossless(opts)
    finally:
        unregister("lookup")


def test_a_registered_method_works_through_the_api(tiny_model_dir, lookup_method):
    tr = Translator.load(tiny_model_dir)
    src = ["the cat the cat the cat the cat .", "a big red book a big red book ."]
    greedy = [r.text for r in tr.translate_batch(src, method="greedy")]
    res = tr.translate_batch(src, method="lookup", ngram=2, width=4)
    assert [r.text for r in res] == greedy
    assert any(r.stats.drafted > 0 for r in res)
    assert "|ngram:2|width:4|" in decode_options("lookup", ngram=2, width=4).signature()
    with pytest.raises(OptionError, match="width: must be >= 1"):
        decode_options("lookup", width=0)


def test_every_output_option_is_in_the_signature():
    for name, method in METHODS.items():
        opts = decode_options(name, **({"drafter": "d"} if "drafter" in method.options.__dataclass_fields__ else {}))
        keys = set(output_options(opts))
        expected = {f.name for f in dataclasses.fields(opts) if f.metadata["output"]}
        assert expected <= keys and {"aggdec", "method"} <= keys, name
        assert ("accept" in keys) == (method.drafter is not None), name
    lossless = decode_options("blockwise", drafter="d")
    lossy = decode_options("blockwise", drafter="d", min_block=2)
    blockwise = METHODS["blockwise"]
    assert blockwise.lossless(lossless) and not blockwise.lossless(lossy)
    assert output_options(lossless)["accept"] == "exact" and output_options(lossy)["accept"] == "minblock2+exact"
    assert decode_options("gad++", drafter="d").signature() != decode_options("gad++", drafter="d", tau=2.0).signature()
    # options that cannot change an output leave the signature alone
    assert decode_options("iad", max_batch_size=8).signature() == decode_options("iad", max_batch_size=64).signature()


def test_greedy_is_the_empty_drafter():
    assert isinstance(METHODS["greedy"].drafter(decode_options("greedy"), None), NoDraft)

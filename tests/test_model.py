"""The cached block-decoding API equals full recomputation (slots at their own positions, beam search's
reordered cache); rollback then re-feed equals fresh computation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import CONFIGS, tiny_model

from aggdec.model.config import ModelConfig
from aggdec.model.slots import SlotCache, Tokens

KINDS = sorted(CONFIGS)


def _random_batch(model, rng, bsz, src_max, tgt_len):
    cfg = model.cfg
    src_lens = [rng.randint(1, src_max) for _ in range(bsz)]
    src = torch.full((bsz, max(src_lens)), cfg.pad, dtype=torch.long)
    for b, n in enumerate(src_lens):
        src[b, : n - 1] = torch.tensor([rng.randint(4, cfg.src_vocab - 1) for _ in range(n - 1)], dtype=torch.long)
        src[b, n - 1] = cfg.eos
    tgt = torch.randint(4, cfg.tgt_vocab, (bsz, tgt_len))
    tgt[:, 0] = cfg.eos
    return src, tgt


def _slots(model, src, length=40):
    """A slot cache holding `src`'s rows (their cross K/V placed), as the decode loop keeps it."""
    cfg = model.cfg
    memory, pad = model.encode(src)
    cache = SlotCache(cfg.dec_layers, cfg.inner_dim(cfg.dec_heads), src.shape[0], length, src.shape[1] + 1,
                      next(model.parameters()).dtype, src.device)
    cache.place(torch.arange(src.shape[0]), model.cross_kv(memory, pad))
    return cache


def _decode(model, cache, block, start, keep=None):
    """Logits of `block` written at each slot's `start`: (B,T,V), or (N,V) at the `keep` positions alone."""
    tokens = Tokens.of(block, start, keep)
    logits = model.output_logits(model.decode_slots(tokens, cache, cache.length - 1, cache.src_width - 1))
    return logits if keep is not None else tokens.grid(logits, 0)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_ragged_blocks_equal_full_recompute(kind, data):
    """Feed each slot's target in random block sizes at its own position, keeping random-length prefixes
    (the rest is rolled back by not advancing); logits of kept positions equal the teacher-forced full
    forward."""
    import random

    model = tiny_model(kind)
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    bsz = data.draw(st.integers(1, 5))
    tgt_len = data.draw(st.integers(1, 20))
    src, tgt = _random_batch(model, rng, bsz, 12, tgt_len)
    with torch.no_grad():
        full = model(src, tgt)
        cache = _slots(model, src)
        got = torch.zeros_like(full)
        lengths = torch.zeros(bsz, dtype=torch.long)
        while int(lengths.min()) < tgt_len:
            t = data.draw(st.integers(1, 6))
            idx = (lengths[:, None] + torch.arange(t)).clamp(max=tgt_len - 1)
            logits = _decode(model, cache, tgt.gather(1, idx), lengths)
            # keep a random number of the block's positions per row (at least 1 unless done)
            room = (tgt_len - lengths).clamp(min=0)
            n = torch.tensor([data.draw(st.integers(min(1, int(r)), min(t, int(r)))) for r in room])
            for b in range(bsz):
                got[b, lengths[b]: lengths[b] + n[b]] = logits[b, : n[b]]
            lengths += n
    torch.testing.assert_close(got, full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_rollback_then_refeed_equals_fresh(kind):
    model = tiny_model(kind)
    import random

    src, tgt = _random_batch(model, random.Random(1), 3, 9, 10)
    with torch.no_grad():
        ref = _decode(model, _slots(model, src), tgt[:, :7], torch.zeros(3, dtype=torch.long))
        cache = _slots(model, src)
        _decode(model, cache, tgt[:, :5], torch.zeros(3, dtype=torch.long))
        _decode(model, cache, torch.randint(4, model.cfg.tgt_vocab, (3, 4)), torch.full((3,), 5))  # a rejected draft
        again = _decode(model, cache, tgt[:, 5:7], torch.full((3,), 5))
    torch.testing.assert_close(again, ref[:, 5:7], rtol=0, atol=1e-10)


def test_a_new_sentence_takes_a_slot():
    """A new sentence placed in a slot (`SlotCache.place`, continuous batching) decodes as it would
    alone, and the other slots are untouched."""
    import random

    model = tiny_model()
    src, tgt = _random_batch(model, random.Random(2), 4, 10, 6)
    with torch.no_grad():
        full = model(src, tgt)
        cache = _slots(model, src)
        _decode(model, cache, tgt[:, :3], torch.zeros(4, dtype=torch.long))
        new_src, new_tgt = _random_batch(model, random.Random(3), 1, 10, 6)
        memory, pad = model.encode(new_src)
        cache.place(torch.tensor([2]), model.cross_kv(memory, pad))
        block = torch.cat([tgt[:, 3:6], tgt[:, 3:6]], dim=0)[:4]
        block[2] = new_tgt[0, :3]
        out = _decode(model, cache, block, torch.tensor([3, 3, 0, 3]))
        new_full = model(new_src, new_tgt)
    torch.testing.assert_close(out[2], new_full[0, :3], rtol=0, atol=1e-10)
    torch.testing.assert_close(out[[0, 1, 3]], full[[0, 1, 3], 3:6], rtol=0, atol=1e-10)


@pytest.mark.parametrize("indirect", [False, True])
def test_beam_reorder_equals_select_on_the_prefix(indirect):
    """reorder gives every row its parent's prefix, lengths and cross K/V, as a cache with a copy of the
    cross K/V per beam does: copying, after its first call into two sets of buffers it reuses instead
    of allocating; `indirect`, moving nothing but its maps of where each row's positions and source
    are stored (read through the CPU attention kernel). With the cross K/V shared by each sentence's
    beams (`group`, as beam search runs), decoding equals decoding with a copy per beam (float64: up
    to the summation order of the attention)."""
    model = tiny_model(seed=5).double().eval()
    rng = __import__("random").Random(5)
    src, tgt = _random_batch(model, rng, 3, 6, 4)
    close = dict(rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        beams = torch.arange(3).repeat_interleave(2)  # 3 sentences x 2 beams, as beam search starts
        cache, ref = model.start(src, group=2, indirect=indirect), model.start(src[beams])
        assert (cache.rows is not None) == indirect
        for c in (cache, ref):
            model.decode(tgt[beams], c)
            c.commit(4)
        storages = set()
        for rows, leave in (([1, 1, 2, 3, 5, 4], False), ([0, 0, 3, 2, 5, 5], False), ([1, 0, 4, 5], True)):
            rows = torch.tensor(rows)
            cache.reorder(rows, 4, take_cross=leave)
            ref.reorder(rows, 4, take_cross=True)
            storages |= {cache.k[0].untyped_storage().data_ptr()}
            assert torch.equal(cache.lengths, ref.lengths)
            at = cache.key_rows(4)
            for a, b in zip(cache.k + cache.v, ref.k + ref.v):  # each row's prefix, where it is stored
                torch.testing.assert_close(a[:, :4] if at is None else a[at, torch.arange(4)], b[:, :4], **close)
            # one row of cross K/V per sentence, read by each of its beams; computed here for 3 rows and
            # there for 6, whose float64 products may differ in the last bits with the row count
            sources = cache.cross_rows()
            for a, b in zip(cache.cross.k + cache.cross.v, ref.cross.k + ref.cross.v):
                torch.testing.assert_close(a[sources], b, **close)
            assert torch.equal(cache.cross.src_pad[sources], ref.cross.src_pad)
        assert len(storages) == (1 if indirect else 2)
        step = torch.randint(4, model.cfg.tgt_vocab, (4, 1))
        torch.testing.assert_close(model.decode(step, cache), model.decode(step, ref), **close)
    if indirect:  # with gradients, attention is the masked products, which cannot read the map
        with pytest.raises(ValueError, match="kernel"):
            model.decode(step, cache)


@pytest.mark.parametrize("kind", KINDS)
def test_encoder_through_the_attention_kernel_equals_masked_products(kind):
    """Inference encodes through the CPU kernel (each token's query over its own sentence's tokens,
    packed where the batch is padded) and equals the masked products that run with gradients on, at
    every real position (float64), padded and unpadded."""
    import random

    from aggdec.model import decode_attention

    model = tiny_model(kind, seed=3).double().eval()
    src, _ = _random_batch(model, random.Random(3), 6, 11, 2)
    full = src[:, :4].clone()
    full[:, -1] = model.cfg.eos  # no padding: the unpacked layout
    assert src.eq(model.cfg.pad).any()
    with torch.no_grad():
        assert decode_attention.usable(src.device, torch.float64)
    for batch in (src, full):
        ref, pad = model.encode(batch)  # gradients on: masked products
        with torch.no_grad():
            got, _ = model.encode(batch)
        torch.testing.assert_close(got[~pad], ref.detach()[~pad], rtol=1e-12, atol=1e-12)


def test_config_validation():
    with pytest.raises(ValueError, match="activation"):
        ModelConfig(src_vocab=8, tgt_vocab=8, activation="tanh")
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(src_vocab=8, tgt_vocab=8, d_model=10, enc_heads=3)
    with pytest.raises(ValueError, match="share_all_embeddings"):
        ModelConfig(src_vocab=8, tgt_vocab=9, share_all_embeddings=True)


@pytest.mark.parametrize("kind", KINDS)
def test_the_live_positions_alone_equal_every_position(kind):
    """decode_slots of a prefix of each slot's block (an eager step's tokens) equals it over every position
    of every slot (a fixed-shape step's) there; later calls see the same cache either way."""
    import random

    model = tiny_model(kind)
    src, tgt = _random_batch(model, random.Random(4), 4, 10, 9)
    n = torch.tensor([1, 4, 2, 6])
    with torch.no_grad():
        a, b = _slots(model, src), _slots(model, src)
        for cache in (a, b):
            _decode(model, cache, tgt[:, :2], torch.zeros(4, dtype=torch.long))
        block, start = tgt[:, 2:8], torch.full((4,), 2)
        valid = torch.arange(6)[None] < n[:, None]
        padded = _decode(model, a, block, start)[valid]
        packed = _decode(model, b, block, start, valid)
        torch.testing.assert_close(packed, padded, rtol=0, atol=1e-10)
        nxt = torch.stack([tgt[r, 2 + int(n[r]): 3 + int(n[r])] for r in range(4)])
        torch.testing.assert_close(_decode(model, b, nxt, 2 + n), _decode(model, a, nxt, 2 + n), rtol=0, atol=1e-10)

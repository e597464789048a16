"""The cached block-decoding API equals full recomputation; rollback then re-feed equals fresh computation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiny_models import CONFIGS, tiny_model

from aggdec.model.config import ModelConfig

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


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_ragged_blocks_equal_full_recompute(kind, data):
    """Feed each row's target in random block sizes, committing random-length prefixes; logits of
    committed positions must equal the teacher-forced full forward."""
    import random

    model = tiny_model(kind)
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    bsz = data.draw(st.integers(1, 5))
    tgt_len = data.draw(st.integers(1, 20))
    src, tgt = _random_batch(model, rng, bsz, 12, tgt_len)
    with torch.no_grad():
        full = model(src, tgt)
        cache = model.start(src, capacity=data.draw(st.integers(1, 8)))
        got = torch.zeros_like(full)
        while int(cache.lengths.min()) < tgt_len:
            pos = cache.lengths.clone()
            t = data.draw(st.integers(1, 6))
            idx = (pos[:, None] + torch.arange(t)).clamp(max=tgt_len - 1)
            block = tgt.gather(1, idx)
            logits = model.decode(block, cache)
            # commit a random number of the block's positions per row (at least 1 unless done)
            room = (tgt_len - pos).clamp(min=0)
            n = torch.tensor([data.draw(st.integers(min(1, int(r)), min(t, int(r)))) for r in room])
            for b in range(bsz):
                for j in range(int(n[b])):
                    got[b, pos[b] + j] = logits[b, j]
            cache.commit(n)
    torch.testing.assert_close(got, full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_rollback_then_refeed_equals_fresh(kind):
    model = tiny_model(kind)
    import random

    src, tgt = _random_batch(model, random.Random(1), 3, 9, 10)
    with torch.no_grad():
        fresh = model.start(src)
        ref = model.decode(tgt[:, :7], fresh)
        cache = model.start(src)
        model.decode(tgt[:, :5], cache)
        cache.commit(torch.tensor([5, 5, 5]))
        model.decode(torch.randint(4, model.cfg.tgt_vocab, (3, 4)), cache)  # a rejected draft
        cache.commit(torch.tensor([0, 1, 2]))  # keep part of it for rows 1, 2 ...
        cache.lengths = torch.tensor([5, 5, 5])  # ... then roll every row back to 5
        again = model.decode(tgt[:, 5:7], cache)
    torch.testing.assert_close(again, ref[:, 5:7], rtol=0, atol=1e-10)


def test_select_and_replace_rows():
    """Finished rows leave (select) and new sentences enter a slot (replace) without touching others."""
    import random

    model = tiny_model()
    src, tgt = _random_batch(model, random.Random(2), 4, 10, 6)
    with torch.no_grad():
        full = model(src, tgt)
        cache = model.start(src)
        model.decode(tgt[:, :3], cache)
        cache.commit(torch.full((4,), 3))
        cache.select(torch.tensor([3, 1]))
        new_src, new_tgt = _random_batch(model, random.Random(3), 1, 14, 6)
        memory, pad = model.encode(new_src)
        cache.replace(torch.tensor([0]), model.cross_kv(memory, pad))
        block = torch.stack([new_tgt[0, :3], tgt[1, 3:6]])
        out = model.decode(block, cache)
        new_full = model(new_src, new_tgt)
    torch.testing.assert_close(out[0], new_full[0, :3], rtol=0, atol=1e-10)
    torch.testing.assert_close(out[1], full[1, 3:6], rtol=0, atol=1e-10)


@pytest.mark.parametrize("indirect", [False, True])
def test_beam_reorder_equals_select_on_the_prefix(indirect):
    """reorder (beam search's select) gives every row its parent's prefix, lengths and cross K/V, as
    select does: copying, after its first call into two sets of buffers it reuses instead of
    allocating; `indirect`, moving nothing but its maps of where each row's positions and source are
    stored (read through the CPU attention kernel). With the cross K/V shared by each sentence's
    beams (`group`, as beam search runs), decoding equals decoding with a copy per beam (float64: up
    to the summation order of the attention)."""
    model = tiny_model(seed=5).double().eval()
    rng = __import__("random").Random(5)
    src, tgt = _random_batch(model, rng, 3, 6, 4)
    close = dict(rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        beams = torch.arange(3).repeat_interleave(2)  # 3 sentences x 2 beams, as beam search starts
        cache, ref = model.start(src, group=2, indirect=indirect), model.start(src)
        assert (cache.rows is not None) == indirect
        ref.select(beams)
        for c in (cache, ref):
            model.decode(tgt[beams], c)
            c.commit(4)
        storages = set()
        for rows, leave in (([1, 1, 2, 3, 5, 4], False), ([0, 0, 3, 2, 5, 5], False), ([1, 0, 4, 5], True)):
            rows = torch.tensor(rows)
            cache.reorder(rows, 4, take_cross=leave)
            ref.select(rows)
            storages |= {cache.k[0].untyped_storage().data_ptr()}
            assert torch.equal(cache.lengths, ref.lengths)
            at = cache.key_rows(4)
            for a, b in zip(cache.k + cache.v, ref.k + ref.v):  # each row's prefix, where it is stored
                torch.testing.assert_close(a[:, :4] if at is None else a[at, torch.arange(4)], b[:, :4], **close)
            sources = cache.cross_rows()  # one row of cross K/V per sentence, read by each of its beams
            for a, b in zip(cache.cross.k + cache.cross.v, ref.cross.k + ref.cross.v):
                assert torch.equal(a[sources], b)
            assert torch.equal(cache.cross.src_pad[sources], ref.cross.src_pad)
        assert len(storages) == (1 if indirect else 2)
        step = torch.randint(4, model.cfg.tgt_vocab, (4, 1))
        torch.testing.assert_close(model.decode(step, cache), model.decode(step, ref), **close)
        with pytest.raises(ValueError, match="reorder"):
            cache.select(torch.tensor([0, 1]))
    if indirect:  # with gradients, attention is the masked products, which cannot read the map
        with pytest.raises(ValueError, match="kernel"):
            model.decode(step, cache)
        with pytest.raises(ValueError, match="one count"):  # its rows stay at one length
            cache.commit(torch.tensor([1, 0, 1, 1]))


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
def test_packed_valid_positions_equal_padded(kind):
    """decode_hidden(valid=...) computes only a prefix of each row's block, packed, and equals the
    padded computation there; later calls see the same cache either way."""
    import random

    model = tiny_model(kind)
    src, tgt = _random_batch(model, random.Random(4), 4, 10, 9)
    n = torch.tensor([1, 4, 2, 6])
    with torch.no_grad():
        a, b = model.start(src), model.start(src)
        for cache in (a, b):
            model.decode(tgt[:, :2], cache)
            cache.commit(torch.full((4,), 2))
        block = tgt[:, 2:8]
        valid = torch.arange(6)[None] < n[:, None]
        padded = model.decode_hidden(block, a)[valid]
        packed = model.decode_hidden(block, b, valid=valid)
        torch.testing.assert_close(packed, padded, rtol=0, atol=1e-10)
        a.commit(n)
        b.commit(n)
        nxt = torch.stack([tgt[r, 2 + int(n[r]) : 3 + int(n[r])] for r in range(4)])
        torch.testing.assert_close(model.decode(nxt, b), model.decode(nxt, a), rtol=0, atol=1e-10)

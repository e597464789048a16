"""T5-family models (T5 v1.0, v1.1 / Flan-T5, mT5; tests/hf_models.py `build_t5`) as verifiers:
greedy token-identical to transformers' `generate`, every method on them, T5's sentencepiece
tokenizer, `convert`, a corpus job; and IAD's cost of an instruction prefix the output never copies."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

transformers = pytest.importorskip("transformers")  # the `hf` extra; CI installs it

import hf_models  # noqa: E402
from conftest import compiles, synthetic_sentences  # noqa: E402
from hf_models import TASK_PREFIX  # noqa: E402

from aggdec import checkpoint  # noqa: E402
from aggdec.api import Translator  # noqa: E402
from aggdec.decoding.iad import InputCopy  # noqa: E402
from aggdec.decoding.state import DecodeState  # noqa: E402
from aggdec.model.draft_head import DraftHead, DraftHeadConfig  # noqa: E402
from aggdec.model.heads import ProposalHeads  # noqa: E402

# one worker builds this module's session fixture once (`make test`: pytest-xdist's loadgroup)
pytestmark = pytest.mark.xdist_group("t5")

LAYOUTS = ("t5", "t5-v1.1", "mt5")  # umt5 (mt5's code with per-layer tables): test_umt5_*
LIMIT = 40  # transformers' max_new_tokens; aggdec's max_len_a = 0, max_len_b = LIMIT
SOURCES = [TASK_PREFIX * (i % 2) + t for i, t in enumerate(synthetic_sentences(60, seed=7))]


@pytest.fixture(scope="session")
def t5_dirs(tmp_path_factory) -> dict[str, Path]:
    """One briefly trained directory per layout, built once per session."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {layout: hf_models.build_t5(tmp_path_factory.mktemp(f"t5-{layout}"), layout) for layout in LAYOUTS}
    finally:
        torch.set_num_threads(threads)


def _hf_greedy(model, src: list[int], **rules) -> list[int]:
    """transformers' greedy output for `src`, without the decoder start and a final eos."""
    with torch.no_grad():
        out = model.generate(torch.tensor([src]), num_beams=1, do_sample=False, max_new_tokens=LIMIT, **rules)
    out = out[0, 1:].tolist()
    return out[:-1] if out and out[-1] == model.config.eos_token_id else out


def _assert_identical(d: Path, texts: list[str], **rules) -> list:
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(d).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    tr = Translator.load(d)
    want = []
    for text in texts:
        src = tok(text).input_ids
        assert tr.prepare(text)[0] == src  # the text's pieces, then </s>
        want.append(_hf_greedy(model, src, **rules))
    for bs in (1, 8):
        results = tr.translate_batch(texts, method="greedy", max_len_a=0, max_len_b=LIMIT, max_batch_size=bs)
        assert [r.tokens for r in results] == want, bs
        assert [r.text for r in results] == [tok.decode(w, skip_special_tokens=True) for w in want]
    return results


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_is_token_identical_to_transformers(t5_dirs, layout):
    """Every sentence of the set, at batch sizes 1 and 8; max_len_b gives max_new_tokens."""
    results = _assert_identical(t5_dirs[layout], SOURCES)
    assert len({tuple(r.tokens) for r in results}) >= 40  # varied outputs, not a constant
    assert any(r.status == "truncated_output" for r in results) or all(len(r.tokens) < LIMIT for r in results)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_random_t5s_are_token_identical_under_aggdecs_rules(layout, tmp_path):
    """Random weights, whose outputs may hold the pad token or start with eos: transformers with
    aggdec's two rules (never pad, eos not first) gives aggdec's output."""
    d = hf_models.build_t5(tmp_path / layout, layout, steps=0, seed=1)
    _assert_identical(d, SOURCES[:12], suppress_tokens=[0], min_new_tokens=1)


def _as_umt5(mt5: Path, out: Path) -> Path:
    """The trained mT5 as a umT5 directory: its weights, and in every self-attention layer a table of
    its own (the first layer's plus noise of half its spread, so that each layer attends otherwise)."""
    model = transformers.MT5ForConditionalGeneration.from_pretrained(mt5)
    fields = {k: v for k, v in model.config.to_dict().items() if k not in ("model_type", "architectures")}
    fields["tie_word_embeddings"] = False  # as trained: no rescale before lm_head (mT5 never rescales)
    umt5 = transformers.UMT5ForConditionalGeneration(transformers.UMT5Config(**fields))
    umt5.lm_head.weight = torch.nn.Parameter(umt5.lm_head.weight.detach().clone())  # built tied; mT5's is not
    state = model.state_dict()
    torch.manual_seed(0)
    for side in ("encoder", "decoder"):
        first = state[f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        for i in range(1, len(getattr(umt5, side).block)):
            state[f"{side}.block.{i}.layer.0.SelfAttention.relative_attention_bias.weight"] = (
                first + 0.5 * first.std() * torch.randn_like(first))
    umt5.load_state_dict(state)
    umt5.eval().save_pretrained(out)
    for f in mt5.iterdir():
        if f.name.startswith(("spiece", "tokenizer")):
            shutil.copy(f, out / f.name)
    return out


def test_umt5_reads_a_bias_table_per_layer_and_is_token_identical(t5_dirs, tmp_path):
    """umT5 (the trained mT5 with a table per layer, and random weights under aggdec's two rules):
    every self-attention layer's own table is loaded, greedy equals transformers' at batch sizes 1
    and 8, and IAD equals greedy."""
    d = _as_umt5(t5_dirs["mt5"], tmp_path / "trained")
    tr = Translator.load(d)
    tables = [t.weight for t in tr.model.decoder.relative_attention_bias]
    assert tr.cfg.relative_per_layer and len(tables) == tr.cfg.dec_layers and not torch.equal(tables[0], tables[1])
    greedy = [r.tokens for r in _assert_identical(d, SOURCES[:16])]
    iad = tr.translate_batch(SOURCES[:16], method="iad", max_len_a=0, max_len_b=LIMIT, max_batch_size=7)
    assert [r.tokens for r in iad] == greedy
    random = hf_models.build_t5(tmp_path / "random", "umt5", steps=0, seed=1)
    _assert_identical(random, SOURCES[:12], suppress_tokens=[0], min_new_tokens=1)


def test_a_t5_without_tokenizer_json_reads_its_spiece_model(t5_dirs, tmp_path):
    """spiece.model and its sentinels tokenize as transformers' T5Tokenizer (built from that file)
    and decode as it does; the model decodes as with tokenizer.json."""
    d = tmp_path / "spiece-only"
    shutil.copytree(t5_dirs["t5-v1.1"], d)
    (d / "tokenizer.json").unlink()
    tr = Translator.load(d)
    assert json.loads((d / "tokenizer_config.json").read_text())["extra_ids"] == 10
    tok = transformers.T5Tokenizer.from_pretrained(d)
    texts = [*SOURCES, "The cat <extra_id_0> dog .", "<extra_id_9>the</s> <unk> x<pad>", "  spaced   out  "]
    for text in texts:
        ids = tok(text).input_ids
        assert tr.bundle.src_tok.encode(text) + [1] == ids
        assert tr.bundle.tgt_tok.decode(ids) == tok.decode(ids, skip_special_tokens=True)
    a = tr.translate_batch(SOURCES, method="greedy", max_len_a=0, max_len_b=LIMIT)
    b = Translator.load(t5_dirs["t5-v1.1"]).translate_batch(SOURCES, method="greedy", max_len_a=0, max_len_b=LIMIT)
    assert [r.tokens for r in a] == [r.tokens for r in b] and [r.text for r in a] == [r.text for r in b]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_method_decodes_a_t5(t5_dirs, layout, tmp_path):
    """IAD (the draft budget's and the longest drafts), GAD (an untrained draft head reading the
    T5's keys of heads * d_kv) and blockwise (untrained proposal heads) equal greedy at batch sizes
    1 and 7; beam search decodes. (The re-alignment options and draft budgets on T5 layouts:
    tests/test_loop.py, tests/test_slot_loop.py.)"""
    sources = SOURCES[:24]
    tr = Translator.load(t5_dirs[layout])
    cfg = tr.cfg
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig(d_model=cfg.d_model, heads=cfg.dec_heads, kv_dim=cfg.inner_dim(cfg.dec_heads),
                                     ffn=48, layers=1, block_size=4))
    checkpoint.save_draft_head(tmp_path / "head", head, {"verifier_sha": tr.bundle.sha})
    checkpoint.save_heads(tmp_path / "heads", ProposalHeads(cfg.d_model, 3, 32), {"verifier_sha": tr.bundle.sha})
    common = dict(max_len_a=0, max_len_b=LIMIT)
    want = [r.tokens for r in tr.translate_batch(sources, method="greedy", max_batch_size=1, **common)]
    for method, extra in (("iad", {}), ("iad", {"draft_length": "max"}),
                          ("gad", {"drafter": str(tmp_path / "head"), "draft_length": "max"}),
                          ("blockwise", {"drafter": str(tmp_path / "heads"), "block_size": 4, "draft_length": "max"})):
        for bs in (1, 7):
            got = tr.translate_batch(sources, method=method, max_batch_size=bs, **common, **extra)
            assert [r.tokens for r in got] == want, (method, extra, bs)
            if method == "iad" and extra:
                assert sum(r.stats.accepted for r in got) > 0  # the copy drafts are used
    beam = tr.translate_batch(sources[:8], method="beam", beam=3, **common)
    assert all(r.status in ("ok", "truncated_output") and r.tokens for r in beam)


@compiles
@pytest.mark.slow  # two compiles; tests/test_slot_loop.py compiles a float64 T5 layout's step in the default run
def test_compiled_steps_decode_a_t5(t5_dirs):
    """The slot loop's compiled step (greedy at 4 slots; IAD at 2, its drafts verified
    in the step) gives the eager greedy output."""
    tr = Translator.load(t5_dirs["t5"])
    want = [r.tokens for r in tr.translate_batch(SOURCES[:16], method="greedy", max_len_a=0, max_len_b=LIMIT)]
    for method, bs in (("greedy", 4), ("iad", 2)):
        got = tr.translate_batch(SOURCES[:16], method=method, compile=True, max_batch_size=bs, max_len_a=0,
                                 max_len_b=LIMIT)
        assert [r.tokens for r in got] == want, method
        loop = list(tr._slot_loops.values())[-1]  # the last call's loop, compiled
        assert loop.compile and loop.compiled.programs


def test_a_draft_head_trained_on_a_t5_is_lossless(t5_dirs, tmp_path):
    """`python -m aggdec.train.draft_head` (features from the T5's greedy outputs from its own start
    token, keys of heads * d_kv; then training) makes a head GAD decodes with: greedy's output."""
    from aggdec.train import draft_head as head_train

    d = t5_dirs["t5-v1.1"]
    data = tmp_path / "src.tsv"
    data.write_text("src\n" + "\n".join(synthetic_sentences(120, seed=5)) + "\n", encoding="utf-8")
    head_train.main(["features", "--verifier", str(d), "--data", str(data), "--column", "src",
                     "--out", str(tmp_path / "feats"), "--threads", "1"])
    head_train.main(["train", "--verifier", str(d), "--features", str(tmp_path / "feats"), "--out",
                     str(tmp_path / "head"), "--block-size", "4", "--ffn", "32", "--positions", "128", "--warmup", "2",
                     "--max-updates", "30", "--valid", "8", "--threads", "1", "--log-interval", "1000"])
    meta = json.loads((tmp_path / "feats" / "features.json").read_text())
    assert meta["argmax_agreement"] > 0.95  # states fed from the T5's start token reproduce its outputs
    tr = Translator.load(d)
    greedy = tr.translate_batch(SOURCES, method="greedy", max_batch_size=8)
    gad = tr.translate_batch(SOURCES, method="gad", drafter=str(tmp_path / "head"), draft_length="max",
                             max_batch_size=8)
    assert [r.tokens for r in gad] == [r.tokens for r in greedy]


def test_convert_writes_a_t5_with_the_same_outputs(t5_dirs, tmp_path):
    from aggdec.fairseq_io import save_fairseq

    d, out = t5_dirs["t5"], tmp_path / "converted"
    run = CliRunner().invoke(__import__("cli").main, ["convert", str(d), str(out), "--from", "transformers"])
    assert run.exit_code == 0, run.output
    config = json.loads((out / "config.json").read_text())
    assert config["conventions"]["decoder_start"] == 0 and config["meta"]["model_type"] == "t5"
    assert config["model"]["relative_buckets"] == 8 and config["model"]["output_scale"] == 32**-0.5
    a = Translator.load(d).translate_batch(SOURCES, method="iad")
    b = Translator.load(out).translate_batch(SOURCES, method="iad")
    assert [r.tokens for r in a] == [r.tokens for r in b] and [r.text for r in a] == [r.text for r in b]
    with pytest.raises(ValueError, match="has no fairseq"):
        save_fairseq(checkpoint.load(d), tmp_path / "fs")


def test_decode_cli_reads_a_t5_directory(t5_dirs):
    run = CliRunner().invoke(__import__("cli").main, ["decode", "-m", str(t5_dirs["mt5"]), "--method", "iad"],
                             input=f"{TASK_PREFIX}She go to school .\nThe cat .\n")
    assert run.exit_code == 0, run.output
    assert len(run.stdout.strip().splitlines()) == 2


def test_a_corpus_job_decodes_a_t5_with_iad(t5_dirs, tmp_path):
    """A Ray job over Parquet shards on the T5 directory itself, method IAD: the API's outputs."""
    from test_hf_import import job_decodes_as_the_api
    from test_jobs import write_corpus, write_spec

    from jobs.spec import load_spec

    d = t5_dirs["t5-v1.1"]
    inp = write_corpus(tmp_path / "in", shards=2, rows=10)
    spec = load_spec(write_spec(tmp_path / "job.toml", d, inp, tmp_path / "out", decode={"method": '"iad"'},
                                resources={"actors": "1"}))
    job_decodes_as_the_api(spec, d, tmp_path / "out", rows=20)


# -- IAD and an instruction prefix ----------------------------------------------------------------

def _iad_calls(drafter: InputCopy, src: list[int], output: list[int], eos: int = 1) -> int:
    """Verifier calls IAD's drafter takes to produce `output` (then eos) from `src` (ids + eos) where
    the verifier's greedy output is `output`: each call accepts the longest prefix of the draft that
    `output` continues with, then the verifier's next token (the loop's steps 1-5, on one row)."""
    target = output + [eos]
    out = torch.zeros(1, len(target) + 1, dtype=torch.long)
    state = DecodeState(src=torch.tensor([src]), src_len=torch.tensor([len(src)]), out=out,
                        out_len=torch.tensor([1]), max_len=torch.tensor([len(target)]), cache=None,
                        requests=[None], pad=0, eos=eos)
    drafter.admit(state, torch.arange(1))
    calls, done = 0, 0
    while done < len(target):
        draft = drafter.propose(state, len(src))  # no draft is longer than the source
        proposed = draft.tokens[0, : int(draft.num_draft[0])].tolist()
        accepted = 0
        while (accepted < len(proposed) and done + accepted < len(target)
               and proposed[accepted] == target[done + accepted]):
            accepted += 1
        done = min(done + accepted + 1, len(target))
        out[0, 1: done + 1] = torch.tensor(target[:done])
        state.out_len = torch.tensor([done + 1])
        drafter.observe(state, draft, torch.tensor([accepted]), None)
        calls += 1
    return calls


def test_the_call_count_model_is_the_loops(t5_dirs):
    """`_iad_calls` on the model's own outputs counts the calls the real loop takes (batch size 1,
    the longest drafts), so that the next tests measure IAD itself."""
    tr = Translator.load(t5_dirs["t5-v1.1"])
    for skip in (False, True):
        results = tr.translate_batch(SOURCES, method="iad", draft_length="max", max_batch_size=1, skip_prefix=skip,
                                     max_len_a=0, max_len_b=LIMIT)
        for text, r in zip(SOURCES, results):
            if r.status == "ok":
                assert _iad_calls(InputCopy(skip_prefix=skip), tr.prepare(text)[0], r.tokens) == r.stats.iterations


def _prefix_costs(prefixed: list[int], src: list[int], output: list[int], **options) -> int:
    """Extra calls IAD takes for `output` from the source `prefixed` than from `src`."""
    return _iad_calls(InputCopy(**options), prefixed, output) - _iad_calls(InputCopy(**options), src, output)


def test_an_instruction_prefix_costs_iad_one_call(t5_dirs):
    """CoEdIT's prefix on sources whose outputs copy their text: one call more (the first draft,
    rejected at its first token) with `skip_prefix`, IAD's default, wherever the text's first token
    is not one of the prefix's (the tiny tokenizer's pieces are nearly characters: sentences that
    start with one of the prefix's pieces are left out); Algorithm 1's re-alignment alone takes more
    where the output's first token occurs twice."""
    tr = Translator.load(t5_dirs["t5-v1.1"])
    texts = synthetic_sentences(60, seed=11)
    prefixed, plain = ([tr.prepare(p + t)[0] for t in texts] for p in (TASK_PREFIX, ""))
    prefix = prefixed[0][: len(prefixed[0]) - len(plain[0])]
    assert all(p == prefix + s for p, s in zip(prefixed, plain))
    costs = {tuple(s): _prefix_costs(p, s, s[:-1], skip_prefix=True) for p, s in zip(prefixed, plain)
             if s[0] not in prefix}
    assert len(costs) >= 30 and set(costs.values()) == {1}
    repeated = [5, 7, 8, 5, 9, 1]  # the first token twice in the text: Algorithm 1 takes a plain step
    assert _prefix_costs([20, 21, 22, *repeated], repeated, repeated[:-1]) == 2
    assert _prefix_costs([20, 21, 22, *repeated], repeated, repeated[:-1], skip_prefix=True) == 1


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_prefix_the_output_never_copies_costs_iad_at_most_one_call(data):
    """Any text, any edited copy of it as the output, any prefix of tokens neither holds: at most one
    call more with `skip_prefix`, at any draft cap. (The other re-alignments guess from where the
    last draft was rejected, which the first call moves: `substitution` takes an output's first
    token that the input lacks for a replacement of the input's first token, inside a prefix; with a
    draft cap, `nearest_match` can pick another occurrence later on, 2 of 18000 random cases here.)"""
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    text = [rng.randint(3, 9) for _ in range(rng.randint(1, 14))]
    output = []
    for t in text:  # keep, substitute, delete or insert
        edit = rng.random()
        output += ([t] if edit < 0.7 else [rng.randint(3, 9)] if edit < 0.8 else [] if edit < 0.9
                   else [rng.randint(3, 9), t])
    prefix = [rng.randint(10, 14) for _ in range(rng.randint(1, 8))]
    cap = data.draw(st.one_of(st.none(), st.integers(1, 6)))
    assert _prefix_costs(prefix + text + [1], text + [1], output, skip_prefix=True, max_draft=cap) <= 1

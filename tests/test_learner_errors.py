"""The learner-error generator: deterministic, keeps the clean side, applies the error types it names."""

from __future__ import annotations

import random

from aggdec.train import learner_errors as le

SENTENCES = [
    "She goes to school every day.",
    "Yesterday she went to the market with her friends.",
    "I have written three letters to the government because I believe it is necessary.",
    "They were happy, but the children didn't want to leave the beautiful house.",
    "He drives carefully in the city.",
    "The people in this country are very friendly.",
]


def test_deterministic_and_slices_match_the_whole():
    whole = le.generate(SENTENCES * 20, seed=7, copies=2)
    assert whole == le.generate(SENTENCES * 20, seed=7, copies=2)
    assert le.generate((SENTENCES * 20)[30:60], seed=7, copies=2, offset=30) == whole[60:120]
    assert whole != le.generate(SENTENCES * 20, seed=8, copies=2)


def test_clean_side_is_the_sentence_in_one_of_two_orthographies():
    for noisy, clean, kinds in le.generate(SENTENCES * 30, seed=1):
        assert clean in SENTENCES or clean in {le.render(le.tokenize(s), True) for s in SENTENCES}
        assert (noisy == clean) == (not kinds)
        assert set(kinds) <= set(le.ERROR_WEIGHTS)


def test_tokenized_rendering():
    toks = le.tokenize("I don't know, she said.")
    assert le.render(toks, tokenized=False) == "I don't know, she said."
    assert le.render(toks, tokenized=True) == "I do n't know , she said ."


def test_share_unchanged_and_error_mix():
    rows = le.generate(SENTENCES * 200, seed=3)
    unchanged = sum(not k for _, _, k in rows) / len(rows)
    assert 0.2 < unchanged < 0.4
    seen = {k for _, _, ks in rows for k in ks}
    assert seen == set(le.ERROR_WEIGHTS)
    assert all(n == c for n, c, _ in le.generate(SENTENCES, seed=3, model=le.LearnerErrors(p_clean=1.0)))


def test_learner_errors_of_the_expected_kind():
    rng = random.Random(0)
    outs = {le.err_agreement(t := le.tokenize("She goes to school ."), rng) and le.render(t, True) for _ in range(5)}
    assert outs == {"She go to school ."}
    assert "Yesterday she go to school ." in _verb_form_errors("Yesterday she went to school .")
    assert "They have went home ." in _verb_form_errors("They have gone home .")


def _verb_form_errors(sentence: str, seeds: int = 40) -> set[str]:
    """The sentences err_verb_form makes of `sentence` over `seeds` seeds."""
    out = set()
    for seed in range(seeds):
        toks = le.tokenize(sentence)
        if le.err_verb_form(toks, random.Random(seed)):
            out.add(le.render(toks, True))
    return out


def test_command_line_writes_one_row_per_sentence_and_copy(tmp_path):
    src = tmp_path / "clean.txt"
    src.write_text("\n".join(SENTENCES) + "\n\n", encoding="utf-8")
    out = tmp_path / "pairs.tsv"
    assert le.main(["--input", str(src), "--out", str(out), "--copies", "3", "--seed", "2"]) == 0
    lines = out.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "source\tnoisy\tclean\terrors"
    assert len(lines) == 1 + 3 * len(SENTENCES)
    assert all(len(line.split("\t")) == 4 for line in lines)

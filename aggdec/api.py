"""Python API: `Translator` turns text into text with any decoding method, plus per-sentence stats.

    from aggdec.api import Translator
    tr = Translator.load("models/gec-base")
    results = tr.translate_batch(["She go to school ."], method="iad", max_batch_size=64)
    results[0].text, results[0].status, results[0].stats.iterations

Every input yields exactly one `TranslationResult`. Statuses: "ok"; "empty" (nothing to decode
after cleaning: the output is ""); "truncated" (longer than the model's source positions, decoded
from the first tokens that fit); "error" (decoding this row raised; `error` says why).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aggdec import checkpoint
from aggdec.checkpoint import Bundle
from aggdec.decoding.acceptance import ExactMatch, MinBlock, TopKTolerance
from aggdec.decoding.blockwise import BlockwiseHeads
from aggdec.decoding.drafters import InputCopy, NoDraft
from aggdec.decoding.limits import max_len_for
from aggdec.decoding.loop import DraftVerifyLoop, pad_batch
from aggdec.decoding.metadata import Hypothesis, Request, RowStats
from aggdec.decoding.nat import NATDrafter
from aggdec.model.projection import OutputProjection, native_bf16
from aggdec.stats import SpeedupStats
from aggdec.text import clean_text

METHODS = ("greedy", "beam", "iad", "gad", "gad++", "blockwise")
NEEDS_DRAFTER = ("gad", "gad++", "blockwise")
VERIFY_PRECISIONS = ("auto", "fp32", "bf16-certified")


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode. Lossless methods (greedy, iad) give greedy's output token for token.

    max_batch_size: active rows at once; max_tokens: cap on the sum of active source tokens.
    max_len_a/b: output length limit a * src_len + b (src_len counts the eos), as fairseq-generate.
    draft_cap: IAD draft tokens per row and call (None: the whole remaining input).
    adaptive_draft: IAD per-row cap / GAD per-row block size that halves on early rejection and
        doubles on full acceptance.
    substitution: IAD fallback after a rejection with no unique re-alignment: keep copying the input
        after the rejected token (a substitution guess) instead of one AR step.
    nearest_match: IAD re-alignment after a rejection where the output's suffix occurs several times in
        the input: take the occurrence nearest the rejected token (a deletion guess) instead of one AR step.
    drafter: GAD/GAD++: NAR drafter model directory; blockwise: proposal-heads directory.
    block_size: GAD block size k (masks per call); blockwise: k-1 proposals from the first k-1
        heads (at most all the heads have).
    top_beta, tau: GAD++ acceptance (top-beta and log-prob gap). min_block: blockwise approximate
        acceptance that always keeps the first `min_block` proposals (Stern et al. 5.3; lossy).
    nbest: results also carry the `nbest` best beam hypotheses (TranslationResult.nbest); > 1 needs
        method beam with beam >= nbest.
    verify_precision: how the verifier's top-1 is computed; outputs are the same either way.
        "fp32": fp32 logits. "bf16-certified": a bf16 output projection whose top-1 is proven equal
        to fp32's, recomputing in fp32 where it cannot be (see aggdec.model.projection).
        "auto": bf16-certified for an fp32 verifier on a CPU with native bf16 (AVX512-BF16, AMX),
        else fp32 (on an H100 it was slower than fp32: see `native_bf16`).
        With bf16-certified, the drafters of lossless methods (NAR drafter, proposal heads) run in
        bf16 too; no output of any method depends on this option.
    """

    method: str = "greedy"
    beam: int = 5
    lenpen: float = 1.0
    max_batch_size: int = 32
    max_tokens: int | None = None
    max_len_a: float = 1.5
    max_len_b: int = 10
    draft_cap: int | None = None
    adaptive_draft: bool = False
    substitution: bool = False
    nearest_match: bool = False
    drafter: str | None = None
    block_size: int = 10
    top_beta: int = 3
    tau: float = 1.0
    top_k_accept: int = 1
    min_block: int = 0
    nbest: int = 1
    verify_precision: str = "auto"

    def __post_init__(self) -> None:
        if self.verify_precision not in VERIFY_PRECISIONS:
            raise ValueError(f"verify_precision must be one of {', '.join(VERIFY_PRECISIONS)}; got {self.verify_precision!r}")
        if self.method in NEEDS_DRAFTER and not self.drafter:
            raise ValueError(f"method {self.method} needs a drafter (a NAR drafter or proposal-heads directory)")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.top_beta < 1 or self.tau < 0:
            raise ValueError(f"top_beta must be >= 1 and tau >= 0; got {self.top_beta}, {self.tau}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.beam < 1:
            raise ValueError(f"beam must be >= 1, got {self.beam}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.draft_cap is not None and self.draft_cap < 1:
            raise ValueError(f"draft_cap must be >= 1, got {self.draft_cap}")
        if self.nbest < 1:
            raise ValueError(f"nbest must be >= 1, got {self.nbest}")
        if self.nbest > 1 and (self.method != "beam" or self.beam < self.nbest):
            raise ValueError(f"nbest > 1 needs method beam with beam >= nbest; got method {self.method}, "
                             f"beam {self.beam}, nbest {self.nbest}")

    @property
    def lossless(self) -> bool:
        """Whether the output is greedy's, token for token (exact top-1 acceptance)."""
        return self.method in ("greedy", "iad", "gad", "blockwise") and self.top_k_accept == 1 and not self.min_block

    def signature(self, sha: str = "") -> str:
        parts = [f"aggdec|method:{self.method}"]
        if self.method == "beam":
            parts.append(f"beam:{self.beam}|lenpen:{self.lenpen}" + (f"|nbest:{self.nbest}" if self.nbest > 1 else ""))
        if self.method == "iad":
            parts.append(f"cap:{self.draft_cap}|adaptive:{int(self.adaptive_draft)}|subst:{int(self.substitution)}"
                         + (f"|nearest:{int(self.nearest_match)}" if self.nearest_match else ""))
        if self.method in ("gad", "gad++"):
            parts.append(f"k:{self.block_size}|adaptive:{int(self.adaptive_draft)}")
        if self.method == "gad++":
            parts.append(f"beta:{self.top_beta}|tau:{self.tau}")
        parts.append(f"len:{self.max_len_a}x+{self.max_len_b}")
        if sha:
            parts.append(f"ckpt:{sha}")
        return "|".join(parts)


@dataclass
class TranslationResult:
    """One decoded sentence.

    score: method beam: the output's normalized score (sum of log-probs incl. eos / len ** lenpen,
        len counting the eos; fairseq's). Other methods: None, since the draft-verify loop keeps no
        log-probs; `Translator.rescore` fills in the sum of log-probs incl. eos at the cost of one
        teacher-forced verifier pass. Always None for "empty" and "error" rows.
    nbest: [(text, normalized score)] of the best `DecodeOptions.nbest` beam hypotheses, best first,
        nbest[0] being (text, score); empty unless nbest > 1 was asked for.
    """

    source: str
    text: str
    tokens: list[int]
    status: str = "ok"
    error: str = ""
    src_len: int = 0  # source tokens incl. eos (after truncation)
    stats: RowStats = field(default_factory=RowStats)
    score: float | None = None
    nbest: list[tuple[str, float]] = field(default_factory=list)


class Translator:
    """A loaded verifier plus its tokenizers; decodes lists or streams of sentences in-process."""

    def __init__(self, bundle: Bundle):
        self.bundle = bundle
        self.model = bundle.model
        self.cfg = bundle.model.cfg
        self._drafters: dict[tuple[str, torch.dtype], object] = {}
        self._projections: dict[bool, OutputProjection] = {}

    def projection(self, verify_precision: str = "auto") -> OutputProjection:
        """The verifier's output projection for `verify_precision` (see DecodeOptions), built once."""
        weight = self.model.output_weight
        if verify_precision == "auto":
            certify = weight.dtype == torch.float32 and native_bf16(weight.device)
        else:
            certify = verify_precision == "bf16-certified"
        if certify not in self._projections:
            if certify and weight.device.type == "cuda":
                warnings.warn("verify_precision='bf16-certified' on a GPU: outputs are unchanged, but on an H100 it "
                              "was 0.14-0.99x as fast as fp32 (bench/results/*-gpu-bf16c.json); 'auto' uses fp32 there",
                              stacklevel=3)
            self._projections[certify] = OutputProjection(weight, certify)
        return self._projections[certify]

    def _drafter_model(self, path: str, bf16: bool = False):
        """Load (once per dtype) a NAR drafter or proposal heads for this verifier; `bf16` casts it to
        bfloat16 (drafts never change a lossless method's output, only how many are accepted)."""
        device = next(self.model.parameters()).device
        dtype = torch.bfloat16 if bf16 else next(self.model.parameters()).dtype
        if (path, dtype) not in self._drafters:
            if (Path(path) / "heads.safetensors").is_file():
                drafter = checkpoint.load_heads(path, self.bundle.sha).to(device=device, dtype=dtype)
            else:
                drafter = checkpoint.load(path, device=device, dtype=dtype)
                if drafter.meta.get("role") != "nar-drafter":
                    raise ValueError(f"{path}: not a NAR drafter (config.json meta.role is {drafter.meta.get('role')!r})")
                if drafter.model.cfg.tgt_vocab != self.cfg.tgt_vocab + 1:
                    raise ValueError(f"{path}: drafter vocabulary ({drafter.model.cfg.tgt_vocab - 1}) differs from the verifier's ({self.cfg.tgt_vocab})")
            self._drafters[(path, dtype)] = drafter
        return self._drafters[(path, dtype)]

    @classmethod
    def load(cls, path: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32) -> "Translator":
        return cls(checkpoint.load(path, device=device, dtype=dtype))

    # -- building requests -----------------------------------------------------------------------

    def prepare(self, source: str) -> tuple[list[int] | None, str, str]:
        """-> (source ids ending in eos or None when empty, status, cleaned text)."""
        text = clean_text(source)
        if not text:
            return None, "empty", text
        ids = self.bundle.src_tok.encode(text)
        if not ids:
            return None, "empty", text
        limit = self.cfg.max_source_positions - 1
        status = "ok"
        if len(ids) > limit:
            ids, status = ids[:limit], "truncated"
        return ids + [self.cfg.eos], status, text

    def _run(self, reqs: list[Request], opts: DecodeOptions) -> list[Hypothesis]:
        if opts.method == "beam":
            from aggdec.decoding.beam import beam_search

            return beam_search(self.model, reqs, beam=opts.beam, lenpen=opts.lenpen, max_batch_size=opts.max_batch_size,
                               nbest=opts.nbest)
        acceptance = ExactMatch()
        projection = self.projection(opts.verify_precision)
        # bf16 drafts cannot change a lossless method's output; lossy ones keep fp32 drafters so that
        # their outputs do not depend on the precision.
        bf16_drafts = projection.certify and opts.lossless
        if opts.method == "greedy":
            drafter = NoDraft()
        elif opts.method == "iad":
            drafter = InputCopy(max_draft=opts.draft_cap, adaptive=opts.adaptive_draft, substitution=opts.substitution,
                                nearest_match=opts.nearest_match)
        elif opts.method == "blockwise":
            heads = self._drafter_model(opts.drafter, bf16=bf16_drafts)
            drafter = BlockwiseHeads(self.model, heads, opts.block_size,
                                     out_weight=projection.weight_bf16 if bf16_drafts else None)
            if opts.top_k_accept > 1:
                acceptance = TopKTolerance(opts.top_k_accept, float("inf"))
        else:
            nat = self._drafter_model(opts.drafter, bf16=bf16_drafts)
            drafter = NATDrafter(nat.model, nat.meta["mask_id"], opts.block_size, adaptive=opts.adaptive_draft)
            if opts.method == "gad++":
                acceptance = TopKTolerance(opts.top_beta, opts.tau)
        if opts.min_block:
            acceptance = MinBlock(acceptance, opts.min_block)
        loop = DraftVerifyLoop(self.model, drafter, acceptance, max_batch_size=opts.max_batch_size,
                               max_tokens=opts.max_tokens, projection=projection)
        return list(loop.run(reqs))

    # -- public ----------------------------------------------------------------------------------

    def translate_batch(self, source: list[str], options: DecodeOptions | None = None, **kwargs) -> list[TranslationResult]:
        """Decode `source` (any order of lengths); results align with `source`.

        Options come from `options` or keyword arguments (`method="iad", max_batch_size=64`, ...).
        A batch that fails is retried row by row, so one bad row yields one "error" result.
        """
        opts = options or DecodeOptions(**kwargs)
        if opts.method in NEEDS_DRAFTER:
            self._drafter_model(opts.drafter)  # a bad drafter is a configuration error: raise now
        results: list[TranslationResult] = []
        reqs: list[Request] = []
        for i, s in enumerate(source):
            ids, status, text = self.prepare(s)
            results.append(TranslationResult(source=text, text="", tokens=[], status=status,
                                             src_len=len(ids) if ids else 0))
            if ids is not None:
                max_len = max_len_for(len(ids), opts.max_len_a, opts.max_len_b, self.cfg.max_target_positions)
                reqs.append(Request(index=i, src=ids, max_len=max(1, max_len)))
        for hyp in self._decode_isolating(reqs, opts, results):
            r = results[hyp.index]
            r.tokens, r.stats = hyp.tokens, hyp.stats
            r.text = self.bundle.tgt_tok.decode(hyp.tokens)
            r.score = getattr(hyp, "score", None)  # beam.BeamHypothesis carries score and nbest
            if opts.nbest > 1:
                r.nbest = [(self.bundle.tgt_tok.decode(toks), score) for toks, score in hyp.nbest]
        return results

    @torch.no_grad()
    def rescore(self, results: list[TranslationResult], *, max_batch_size: int = 32) -> None:
        """Set `score` of every "ok"/"truncated" result whose score is None to the verifier's sum of
        log-probs of its tokens plus eos given its (cleaned, truncated) source.

        One teacher-forced pass per batch of `max_batch_size` rows, sorted by length; the log-probs
        are unconstrained (as beam's, an eos forced at max_len scores its own probability).
        """
        todo = [r for r in results if r.score is None and r.status in ("ok", "truncated")]
        todo.sort(key=lambda r: len(r.tokens))
        cfg = self.cfg
        device = next(self.model.parameters()).device
        for start in range(0, len(todo), max_batch_size):
            batch = todo[start: start + max_batch_size]
            src = pad_batch([self.prepare(r.source)[0] for r in batch], cfg.pad, device)
            prev = pad_batch([[cfg.eos] + r.tokens for r in batch], cfg.pad, device)
            gold = pad_batch([r.tokens + [cfg.eos] for r in batch], cfg.pad, device)
            logits = self.model(src, prev)
            dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
            lprobs = torch.log_softmax(logits.to(dtype), dim=-1).gather(2, gold[:, :, None])[:, :, 0]
            sums = lprobs.masked_fill(gold.eq(cfg.pad), 0.0).sum(dim=1).tolist()
            for r, score in zip(batch, sums):
                r.score = score

    def _decode_isolating(self, reqs: list[Request], opts: DecodeOptions, results: list[TranslationResult]) -> list[Hypothesis]:
        try:
            return self._run(reqs, opts)
        except Exception as e:  # isolate the failing row(s); never lose a row
            if len(reqs) <= 1:
                for r in reqs:
                    results[r.index].status = "error"
                    results[r.index].error = f"{type(e).__name__}: {e}"[:500]
                return []
        hyps = []
        for r in reqs:
            hyps.extend(self._decode_isolating([r], opts, results))
        return hyps

    def translate_iterable(self, source: Iterable[str], options: DecodeOptions | None = None, *,
                           chunk_size: int = 1024, **kwargs) -> Iterator[TranslationResult]:
        """Stream results in input order, decoding `chunk_size` sentences at a time."""
        chunk: list[str] = []
        for s in source:
            chunk.append(s)
            if len(chunk) >= chunk_size:
                yield from self.translate_batch(chunk, options, **kwargs)
                chunk = []
        if chunk:
            yield from self.translate_batch(chunk, options, **kwargs)


def summarize(results: list[TranslationResult], seconds: float | None = None) -> dict:
    """Corpus totals for a list of results: counts by status and merged SpeedupStats."""
    total = SpeedupStats()
    status: dict[str, int] = {}
    for r in results:
        status[r.status] = status.get(r.status, 0) + 1
        if r.status in ("ok", "truncated"):
            total.add(r.stats, len(r.tokens) + 1)
    out = {"rows": len(results), "status": status, **total.to_dict()}
    if seconds is not None:
        out["seconds"] = seconds
        out["sentences_per_s"] = len(results) / seconds if seconds > 0 else 0.0
    return out


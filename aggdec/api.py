"""Python API: `Translator` turns text into text with any decoding method, plus per-sentence stats.

    from aggdec.api import Translator
    tr = Translator.load("models/gec-base")
    results = tr.translate_batch(["She go to school ."], method="iad", max_batch_size=64)
    results[0].text, results[0].status, results[0].stats.iterations

Every input yields exactly one `TranslationResult`. Statuses (aggdec.schema.STATUSES): "ok";
"empty" (nothing to decode after cleaning: the output is ""); "truncated" (longer than the model's
source positions, decoded from the first tokens that fit); "truncated_output" (the output reached
the length limit and was cut there); "unknown_tokens" (most of the source is text the vocabulary
lacks; decoded anyway); "invalid_output" (the output's byte tokens do not form UTF-8: U+FFFD in its
text); "lost_characters" (the tokenizer drops characters of the source, such as bidirectional marks:
`error` names them); "error" (decoding this row raised; `error` says why). A row has one status, the
first that applies in that order; `error` also names lost characters where another status won.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aggdec import checkpoint
from aggdec.allocator import keep_freed_memory
from aggdec.bundle import Bundle
from aggdec.conventions import Framing
from aggdec.decoding.limits import max_len_for
from aggdec.decoding.metadata import Hypothesis, Request, RowStats
from aggdec.decoding.method_options import decode_options
from aggdec.decoding.methods import DraftContext, drafts_in_bf16, get_method, invariant_for
from aggdec.decoding.options import DecodeOptions
from aggdec.decoding.scheduler import pad_batch
from aggdec.double_token import teacher_forcing
from aggdec.model.precision import cpu_isa, cpu_warning, refuse_int8, with_precision
from aggdec.model.projection import OutputProjection, certified_pays
from aggdec.model.transformer import Transformer
from aggdec.schema import DECODED_STATUSES, count_status
from aggdec.stats import SpeedupStats
from aggdec.text import clean_text, lost_characters, name_characters
from aggdec.thresholds import AUTO_CERTIFIED_ROWS, CHUNK_SIZE

__all__ = ["DecodeOptions", "TranslationResult", "Translator", "decode_options", "summarize"]


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
    """A loaded verifier plus its tokenizers; decodes lists or streams of sentences in-process.

    Constructing one sets glibc's allocator to keep freed memory for the process
    (aggdec.allocator.keep_freed_memory)."""

    def __init__(self, bundle: Bundle):
        keep_freed_memory()
        self.bundle = bundle
        self.model = bundle.model
        self.cfg = bundle.model.cfg
        self._drafters: dict[tuple[str, torch.dtype], object] = {}
        self._models: dict[str, Transformer] = {"fp32": bundle.model}
        self._projections: dict[tuple[str, bool, int], OutputProjection] = {}
        self._budgets: dict = {}  # draft budgets (aggdec.decoding.budget) by (options, stream), kept across calls
        self._slot_loops: dict = {}  # slot loops by options (thresholds.KEPT_LOOPS), with their compiled steps
        # requests decoded by each backend over this translator's calls (compile_choice.backend: "eager",
        # "compiled", "CUDA graphs")
        self.backends: Counter[str] = Counter()

    def verifier(self, precision: str = "fp32") -> Transformer:
        """The model at `precision` (aggdec.model.precision: fp32, bf16, int8), converted once; on a
        CPU where that precision is expected to run much slower than fp32 (precision.cpu_warning),
        the conversion warns once (one line, with the measured figure)."""
        if precision not in self._models:
            if next(self.model.parameters()).device.type == "cpu":
                slow = cpu_warning(precision, cpu_isa())
                if slow:
                    warnings.warn(slow, stacklevel=2)
            elif precision == "int8":
                refuse_int8(next(self.model.parameters()).device)
            self._models[precision] = with_precision(self.model, precision)
        return self._models[precision]

    def projection(self, verify_precision: str = "auto", precision: str = "fp32") -> OutputProjection:
        """The output projection of the verifier at `precision` for `verify_precision` (see
        DecodeOptions), built once; the certified bf16 top-1 applies to fp32 and half verifiers (not int8), and
        under `auto` to calls of at least `AUTO_CERTIFIED_ROWS` positions."""
        model = self.verifier(precision)
        weight = model.output_weight
        fp32 = weight.dtype != torch.float64 and model.output_int8 is None  # logits in fp32 (fp32, bf16 verifiers)
        if verify_precision == "auto":
            certify = fp32 and certified_pays(weight.device)
        else:
            certify = verify_precision == "bf16-certified" and fp32
        certify_from = AUTO_CERTIFIED_ROWS if certify and verify_precision == "auto" else 1
        key = (precision, certify, certify_from)
        if key not in self._projections:
            if certify and weight.device.type == "cuda":
                warnings.warn("verify_precision='bf16-certified' on a GPU: outputs are unchanged, but it is slower "
                              "than fp32 there (docs/benchmarks.md); 'auto' uses fp32 on GPUs", stacklevel=3)
            self._projections[key] = OutputProjection(weight, certify, model.output_bias, int8=model.output_int8,
                                                      certify_from=certify_from)
        return self._projections[key]

    def _drafter_model(self, path: str, bf16: bool = False, dtype: torch.dtype | None = None):
        """Load (once per dtype) a draft head or proposal heads for this verifier, in `dtype` (default:
        the verifier's); `bf16` casts it to bfloat16 (drafts never change a lossless method's output,
        only how many are accepted)."""
        device = next(self.model.parameters()).device
        dtype = torch.bfloat16 if bf16 else dtype or next(self.model.parameters()).dtype
        if (path, dtype) not in self._drafters:
            self._drafters[(path, dtype)] = checkpoint.load_drafter(path, self.bundle, device=device, dtype=dtype)
        return self._drafters[(path, dtype)]

    def _context(self, opts: DecodeOptions) -> DraftContext:
        model = self.verifier(opts.precision)
        projection = self.projection(opts.verify_precision, opts.precision)
        dtype = next(model.parameters()).dtype
        return DraftContext(model, projection, drafts_in_bf16(opts, projection),
                            lambda path, bf16: self._drafter_model(path, bf16, dtype),
                            self._budgets, prompt=self.framing(opts).prompt, slot_loops=self._slot_loops,
                            backends=self.backends)

    def framing(self, opts: DecodeOptions | None = None) -> Framing:
        """The model's special-token framing for the languages of `opts` (aggdec.conventions); raises
        OptionError naming source_lang / target_lang when one is missing or unknown."""
        opts = opts or decode_options()
        return self.bundle.conventions.resolve(self.cfg.eos, opts.source_lang, opts.target_lang)

    @classmethod
    def load(cls, path: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
             trust: bool = False) -> "Translator":
        """A model directory (checkpoint.load); `trust` allows a Hugging Face directory's pickled
        pytorch_model.bin."""
        return cls(checkpoint.load(path, device=device, dtype=dtype, trust=trust))

    # -- building requests -----------------------------------------------------------------------

    def prepare(self, source: str, framing: Framing | None = None) -> tuple[list[int] | None, str, str]:
        """-> (source ids framed by `framing` (default: the model's default languages; fairseq: the
        text's ids + eos) or None when empty, status, cleaned text)."""
        framing = framing or self.framing()
        text = clean_text(source)
        if not text:
            return None, "empty", text
        ids = self.bundle.src_tok.encode(text)
        if not ids:
            return None, "empty", text
        limit = self.cfg.max_source_positions - len(framing.prefix) - len(framing.suffix)
        status = "ok"
        if len(ids) > limit:
            ids, status = ids[:limit], "truncated"
        return [*framing.prefix, *ids, *framing.suffix], status, text

    def _run(self, reqs: list[Request], opts: DecodeOptions) -> list[Hypothesis]:
        return get_method(opts.method).decode(opts, reqs, self._context(opts))

    # -- public ----------------------------------------------------------------------------------

    def drafting(self, options: DecodeOptions) -> dict:
        """What the draft budgets of `options` (`draft_length = "auto"`) did over this translator's calls:
        {"calls": verifier calls they chose for, "drafting_calls": those given a draft, "budget": why each
        drafts as it does now (`DraftBudget.describe`), one per decoding stream and backend}; zeros and
        no reasons where `options` has no budget."""
        budgets = [b for (opts, *_), b in self._budgets.items() if opts == options]
        return {"calls": sum(b.calls for b in budgets), "drafting_calls": sum(b.drafting_calls for b in budgets),
                "budget": list(dict.fromkeys(b.describe() for b in budgets if b.calls))}

    def translate_batch(self, source: list[str], options: DecodeOptions | None = None, **kwargs) -> list[TranslationResult]:
        """Decode `source` (any order of lengths); results align with `source`.

        Options come from `options` or keyword arguments (`method="iad", max_batch_size=64`, ...; see
        `decode_options`). A batch that fails is retried row by row, so one bad row yields one "error"
        result; a bad option or drafter raises before any decoding.
        """
        opts = options or decode_options(**kwargs)
        method = get_method(opts.method)
        framing = self.framing(opts)
        self.verifier(opts.precision)  # a precision the device refuses is a configuration error: raise now
        if method.drafter is not None:
            method.drafter(opts, self._context(opts))  # a bad drafter is a configuration error: raise now
            invariant_for(opts, self.verifier(opts.precision), method.lossless(opts))  # as are kernels that cannot run
        results: list[TranslationResult] = []
        reqs: list[Request] = []
        lost_in: set[int] = set()  # rows whose source lost characters in tokenization
        for i, s in enumerate(source):
            ids, status, text = self.prepare(s, framing)
            results.append(TranslationResult(source=text, text="", tokens=[], status=status,
                                             src_len=len(ids) if ids else 0))
            body = ids[len(framing.prefix): len(ids) - len(framing.suffix)] if ids else []
            if ids is not None and status == "ok" and self.bundle.src_tok.unrepresented(body) > opts.max_unknown_share:
                results[-1].status = "unknown_tokens"
                results[-1].error = "most of the source is text the model's vocabulary lacks (unknown or byte tokens)"
            if ids is not None and (lost := lost_characters(text, self.bundle.src_tok.decode(body))):
                lost_text = f"the tokenizer drops {len(lost)} character(s) of the source: {name_characters(lost)}"
                results[-1].error = "; ".join(filter(None, [results[-1].error, lost_text]))
                lost_in.add(i)
            if ids is not None:
                max_len = max_len_for(len(ids), opts.max_len_a, opts.max_len_b, self.cfg.max_target_positions)
                reqs.append(Request(index=i, src=ids, max_len=max(1, max_len)))
        limits = {r.index: r.max_len for r in reqs}
        for hyp in self._decode_isolating(reqs, opts, results):
            r = results[hyp.index]
            r.tokens, r.stats = hyp.tokens, hyp.stats
            if r.status == "ok" and len(hyp.tokens) >= limits[hyp.index]:
                r.status = "truncated_output"
                r.error = f"the output reached the length limit ({limits[hyp.index]} tokens) and was cut there"
            r.text = self.bundle.tgt_tok.decode(hyp.tokens)
            if r.status == "ok" and (broken := r.text.count("\ufffd") - r.source.count("\ufffd")) > 0:
                r.status = "invalid_output"
                broken_text = f"the output's byte tokens do not form UTF-8: {broken} U+FFFD in its text"
                r.error = "; ".join(filter(None, [broken_text, r.error]))
            elif r.status == "ok" and hyp.index in lost_in:
                r.status = "lost_characters"
            r.score = getattr(hyp, "score", None)  # beam.BeamHypothesis carries score and nbest
            if getattr(opts, "nbest", 1) > 1:
                r.nbest = [(self.bundle.tgt_tok.decode(toks), score) for toks, score in hyp.nbest]
        return results

    @torch.inference_mode()
    def rescore(self, results: list[TranslationResult], *, max_batch_size: int = 32,
                options: DecodeOptions | None = None) -> None:
        """Set `score` of every "ok"/"truncated" result whose score is None to the verifier's sum of
        log-probs of its tokens plus eos given its (cleaned, truncated) source.

        One teacher-forced pass per batch of `max_batch_size` rows, sorted by length; the log-probs
        are unconstrained (as beam's, an eos forced at max_len scores its own probability); a
        double-token model scores its folded stream (aggdec.double_token). `options`
        gives the languages of a multilingual model (default: its defaults) and the precision.
        """
        framing = self.framing(options)
        model = self.verifier((options or decode_options()).precision)
        todo = [r for r in results if r.score is None and r.status in DECODED_STATUSES]
        todo.sort(key=lambda r: len(r.tokens))
        cfg = self.cfg
        device = next(self.model.parameters()).device
        for start in range(0, len(todo), max_batch_size):
            batch = todo[start: start + max_batch_size]
            src = pad_batch([self.prepare(r.source, framing)[0] for r in batch], cfg.pad, device)
            if cfg.double_token:  # the folded stream, both end-of-decoding slots included
                io = [teacher_forcing(r.tokens, cfg.bos, framing.start, cfg.eos) for r in batch]
                prev = pad_batch([p for p, _ in io], cfg.pad, device)
                gold = pad_batch([z for _, z in io], cfg.pad, device)
            else:
                prev = pad_batch([[framing.start] + r.tokens for r in batch], cfg.pad, device)
                gold = pad_batch([r.tokens + [cfg.eos] for r in batch], cfg.pad, device)
            logits = model(src, prev)
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
            # said once a reason: the rows are decoded alone, correct but many times slower
            warnings.warn(f"aggdec: a batch of {len(reqs)} sentences failed ({type(e).__name__}: {e}); decoding its "
                          f"rows one at a time", stacklevel=2)
        hyps = []
        for r in reqs:
            hyps.extend(self._decode_isolating([r], opts, results))
        return hyps

    def translate_iterable(self, source: Iterable[str], options: DecodeOptions | None = None, *,
                           chunk_size: int = CHUNK_SIZE, **kwargs) -> Iterator[TranslationResult]:
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
    for r in results:
        if r.status in DECODED_STATUSES:
            total.add(r.stats, len(r.tokens) + 1)
    out = {"rows": len(results), "status": count_status(r.status for r in results), **total.to_dict()}
    if seconds is not None:
        out["seconds"] = seconds
        out["sentences_per_s"] = len(results) / seconds if seconds > 0 else 0.0
    return out


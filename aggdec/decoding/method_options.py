"""Each decoding method's options, and the registry of method names to their options classes
(`OPTIONS`; `aggdec.decoding.methods.register` adds to it). Torch-free, like `aggdec.decoding.options`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from aggdec.decoding.options import (AdaptiveDraft, CompiledStep, DecodeOptions, Drafting, DraftModel, OptionError,
                                     coerce, option, option_fields, type_hints)
from aggdec.thresholds import DRAFTER_COMPILE_SAVES_S, GREEDY_COMPILE_SAVES_S, IAD_COMPILE_SAVES_S

if TYPE_CHECKING:
    from aggdec.decoding.acceptance import Acceptance


@dataclass(frozen=True, kw_only=True)
class GreedyOptions(CompiledStep, DecodeOptions):
    """Greedy decoding: one verifier call per output token; the reference of every lossless method."""

    method: ClassVar[str] = "greedy"
    compile_saves_s: ClassVar[float] = GREEDY_COMPILE_SAVES_S


@dataclass(frozen=True, kw_only=True)
class IADOptions(CompiledStep, Drafting, AdaptiveDraft, DecodeOptions):
    """IAD's options (aggdec.decoding.iad); with adaptive_draft a row's cap moves between 4 and draft_cap."""

    method: ClassVar[str] = "iad"
    auto_below: ClassVar[int | None] = 3
    compile_saves_s: ClassVar[float] = IAD_COMPILE_SAVES_S

    draft_cap: int | None = option(None, "Most draft tokens per row and verifier call (none: the whole remaining "
                                         "input).", low=1)
    substitution: bool = option(False, "After a rejection with no unique re-alignment, keep copying the input "
                                       "after the rejected token (a substitution guess) instead of one AR step.")
    nearest_match: bool = option(False, "After a rejection where the output's suffix occurs several times in the "
                                        "input, re-align at the occurrence nearest the rejected token (a deletion "
                                        "guess) instead of one AR step.")
    skip_prefix: bool = option(True, "Where the output's first token has no unique match in the input, re-align at "
                                     "its first occurrence (the output starts past text it never copies, such as "
                                     "an instruction prefix: 'Fix grammatical errors in this sentence: ...') "
                                     "instead of one AR step.", output=False)

    def validate(self) -> None:
        super().validate()
        if self.adaptive_draft and self.draft_cap is None:
            raise OptionError("adaptive_draft", "with method iad needs draft_cap")


@dataclass(frozen=True, kw_only=True)
class GADOptions(CompiledStep, Drafting, DraftModel, DecodeOptions):
    """GAD (SpecDec, aggdec.decoding.gad_head): a draft head proposes `block_size` tokens, exact top-1
    verification (lossless unless min_block > 0)."""

    method: ClassVar[str] = "gad"
    compile_saves_s: ClassVar[float] = DRAFTER_COMPILE_SAVES_S

    def acceptance(self) -> Acceptance:
        from aggdec.decoding.acceptance import ExactMatch, MinBlock

        return MinBlock.around(ExactMatch(), self.min_block)


@dataclass(frozen=True, kw_only=True)
class GADPlusOptions(GADOptions):
    """GAD++: a drafted token is accepted within the verifier's top-beta and log-prob gap tau (lossy)."""

    method: ClassVar[str] = "gad++"

    top_beta: int = option(3, "Accept a drafted token within the verifier's top-beta ...", low=1)
    tau: float = option(1.0, "... and within tau of the top log-probability.", low=0)

    def acceptance(self) -> Acceptance:
        from aggdec.decoding.acceptance import MinBlock, TopKTolerance

        return MinBlock.around(TopKTolerance(self.top_beta, self.tau), self.min_block)


@dataclass(frozen=True, kw_only=True)
class BlockwiseOptions(CompiledStep, Drafting, DraftModel, DecodeOptions):
    """Blockwise parallel decoding (aggdec.decoding.blockwise): `drafter` is a proposal-heads directory;
    lossless with top_k_accept 1 and min_block 0."""

    method: ClassVar[str] = "blockwise"
    compile_saves_s: ClassVar[float] = DRAFTER_COMPILE_SAVES_S

    top_k_accept: int = option(1, "Accept proposals within the verifier's top-k (1: exact, lossless).", low=1)

    def acceptance(self) -> Acceptance:
        from aggdec.decoding.acceptance import ExactMatch, MinBlock, TopKTolerance

        inner = TopKTolerance(self.top_k_accept, float("inf")) if self.top_k_accept > 1 else ExactMatch()
        return MinBlock.around(inner, self.min_block)


@dataclass(frozen=True, kw_only=True)
class BeamOptions(DecodeOptions):
    """Beam search as fairseq-generate --beam (aggdec.decoding.beam; not a draft -> verify method); over
    token pairs for a double-token model (aggdec.decoding.pair_beam)."""

    method: ClassVar[str] = "beam"
    draft_verify: ClassVar[bool] = False

    beam: int = option(5, "Beam size.", low=1)
    lenpen: float = option(1.0, "Length penalty: hypotheses are ranked by sum of log-probs / len ** lenpen.")
    nbest: int = option(1, "Results also carry the nbest best hypotheses with their scores.", low=1)

    def validate(self) -> None:
        if self.nbest > self.beam:
            raise OptionError("nbest", f"must be <= beam ({self.beam}), got {self.nbest}")


OPTIONS: dict[str, type[DecodeOptions]] = {
    cls.method: cls for cls in (GreedyOptions, BeamOptions, IADOptions, GADOptions, GADPlusOptions, BlockwiseOptions)}
"""Method name -> options class, in the order `aggdec decode --method` lists them."""


def get_options(method: str) -> type[DecodeOptions]:
    """The options class of `method`; OptionError naming `method` where none is registered."""
    if method not in OPTIONS:
        raise OptionError("method", f"must be one of {', '.join(OPTIONS)}; got {method!r}")
    return OPTIONS[method]


def decode_options(method: str = "greedy", **fields: Any) -> DecodeOptions:
    """The options of `method` with the given fields (the rest at their defaults); raises OptionError
    naming the field for an unknown or invalid option."""
    cls = get_options(method)
    known = option_fields(cls)
    for name in fields:
        if name not in known:
            raise OptionError(name, f"not an option of method {method} (its options: {', '.join(known)})")
    return cls(**fields)


def all_options() -> dict[str, tuple[Any, Any]]:
    """{name: (dataclasses.Field, type hint)} of every option of every registered method."""
    out: dict[str, tuple[Any, Any]] = {}
    for cls in OPTIONS.values():
        hints = type_hints(cls)
        for name, f in option_fields(cls).items():
            out.setdefault(name, (f, hints[name]))
    return out


def options_from_mapping(data: Mapping[str, Any], default_method: str) -> tuple[DecodeOptions, list[str]]:
    """Options from a table such as a job spec's [decode]: `method` (default `default_method`) plus option
    values as read from TOML or `--set` (`options.coerce`) -> (options, names given that belong to other
    methods and were ignored). Raises OptionError naming the field for an unknown name or a bad value."""
    method = data.get("method", default_method)
    if not isinstance(method, str):
        raise OptionError("method", f"must be a string, got {method!r}")
    cls = get_options(method)
    own, hints, every = option_fields(cls), type_hints(cls), all_options()
    fields, unused = {}, []
    for name, value in data.items():
        if name in own:
            fields[name] = coerce(name, value, hints[name])
        elif name in every:
            unused.append(name)
        elif name != "method":
            raise OptionError(name, f"unknown option; known: {', '.join(sorted(['method', *every]))}")
    return cls(**fields), sorted(unused)


def to_mapping(opts: DecodeOptions) -> dict[str, Any]:
    """{"method": ..., option: value, ...}: the inverse of options_from_mapping."""
    return {"method": opts.method, **{name: getattr(opts, name) for name in option_fields(type(opts))}}

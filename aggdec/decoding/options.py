"""Decoding options, each declared once as a field of a frozen dataclass whose metadata (`option`)
drives validation, the `aggdec decode` flags, the job spec's `[decode]` table and the output signature
(docs/design.md, "Options and the method registry"). `DecodeOptions` holds the fields every method has;
each method adds its own in a subclass (`aggdec.decoding.method_options`). Torch-free.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from aggdec.model.config import PRECISIONS
from aggdec.versions import package_version

if TYPE_CHECKING:
    from aggdec.decoding.acceptance import Acceptance

VERIFY_PRECISIONS = ("auto", "fp32", "bf16-certified")


class OptionError(ValueError):
    """An invalid option; `name` is the field at fault and the message starts with it."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.name, self.message = name, message


def option(default: Any, help: str, *, low: float | None = None, choices: tuple[str | bool, ...] | None = None,
           flag: str | None = None, output: bool = True, path: bool = False) -> Any:
    """A dataclass field with its documentation and rules. low: smallest allowed value (None allowed
    where the type is optional); choices: allowed values (strings, and bools where the type has them);
    flag: the `aggdec decode` flag (default --field-name); output: False for options that never change an
    output (left out of the signature); path: a directory path (checked to exist by the CLI)."""
    meta = {"help": help, "low": low, "choices": choices, "flag": flag, "output": output, "path": path}
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class DecodeOptions:
    """Options every method has. Subclasses add a method's own options and set `method`."""

    method: ClassVar[str] = ""
    draft_verify: ClassVar[bool] = True
    """Whether the method runs the draft -> verify loop (its output then depends on `acceptance()`)."""

    max_batch_size: int = option(64, "Most sentences decoded at once (continuous batching).", low=1,
                                 flag="--batch-size", output=False)
    max_tokens: int | None = option(None, "Most source tokens decoded at once (none: no token budget).", low=1,
                                    output=False)
    max_len_a: float = option(1.5, "Output length limit a * src_len + b (src_len counts the eos), as "
                                   "fairseq-generate.", low=0)
    max_len_b: int = option(10, "Output length limit a * src_len + b.", low=0)
    max_unknown_share: float = option(0.5, "Rows whose source tokens are more than this share unknown or byte-fallback "
                                           "tokens (a script the vocabulary lacks) get status unknown_tokens; they are "
                                           "still decoded.", low=0)
    source_lang: str | None = option(None, "Source language code of a multilingual model (M2M100, NLLB, mBART; "
                                           "e.g. en, eng_Latn, en_XX); none: the model's default.")
    target_lang: str | None = option(None, "Target language code of a multilingual model; its token starts or is "
                                           "forced at the start of every output. None: the model's default.")
    precision: str = option(
        "fp32", "The verifier's arithmetic, encoder included (aggdec.model.precision). fp32: the model as "
                "trained. bf16: bfloat16 weights and activations. int8: int8 linear layers and output projection "
                "(per-channel weights, per-token activations). Lossless methods give the output of greedy at the "
                "same precision; bf16 and int8 outputs may differ from fp32's.", choices=PRECISIONS)
    verify_precision: str = option(
        "auto", "How the verifier's top-1 is computed; outputs are the same either way. fp32: fp32 logits. "
                "bf16-certified: a bf16 output projection whose top-1 is proven equal to fp32's, recomputed in "
                "fp32 where it cannot be (aggdec.model.projection); the drafters of lossless methods then run "
                "in bf16 too. auto: bf16-certified for an fp32 or bf16 verifier on a CPU with AMX or AVX512-BF16, on "
                "calls of enough positions (aggdec.thresholds.AUTO_CERTIFIED_ROWS), else fp32.",
        choices=VERIFY_PRECISIONS, output=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if meta.get("low") is not None and value is not None and value < meta["low"]:
                raise OptionError(f.name, f"must be >= {meta['low']}, got {value}")
            choices = meta.get("choices")
            if choices and (value not in choices or not isinstance(value, tuple(type(c) for c in choices))):
                raise OptionError(f.name, f"must be one of {', '.join(map(choice_text, choices))}; got {value!r}")
        self.validate()

    def validate(self) -> None:
        """Rules that involve several fields; raise OptionError naming one of them."""

    def acceptance(self) -> Acceptance:
        """The acceptance rule of a draft -> verify method: exact top-1 unless the method says otherwise."""
        from aggdec.decoding.acceptance import ExactMatch

        return ExactMatch()

    def signature(self, sha: str = "") -> str:
        """A string that changes with anything that can change an output (`signature`)."""
        return signature(self, sha)


@dataclass(frozen=True, kw_only=True)
class Drafting:
    """Mixin: options of every draft -> verify method."""

    draft_length: str = option("auto", "auto: each call drafts the length that maximizes measured output tokens per "
                                       "second (aggdec.decoding.budget), down to plain greedy steps where drafting "
                                       "does not pay; max: always the drafter's longest draft. With lossy acceptance "
                                       "(gad++, top_k_accept, min_block), auto's output depends on which calls "
                                       "drafted, so on timing; max gives the same output on every run.",
                               choices=("auto", "max"))


@dataclass(frozen=True, kw_only=True)
class CompiledStep:
    """Mixin: methods whose decoder step the slot loop runs: compiled on a CPU (`compile`), batch-invariant
    (`invariant`). `auto_below`: the batch
    size from which the compiled step measured no faster than eager steps, where `auto` does not compile
    (None: none). `compile_saves_s`: the seconds the compiled step measured saving a sentence at batch
    size 1 (0: not measured), for `compile = "auto"` where this machine has not measured both."""

    auto_below: ClassVar[int | None] = None
    compile_saves_s: ClassVar[float] = 0.0

    compile: bool | str = option(
        "auto", "On a CPU, compile each decoder step with TorchInductor: 20-60 s once per machine, stored for "
                "every later process (aggdec cache list). true: compile (fp32 verifiers). auto: where this "
                "machine measured it faster and the call repays loading or building it; logged once.",
        choices=("auto", True, False), output=False)
    invariant: bool | str = option(
        "auto", "The verifier's products, norms and attention through Triton kernels whose every row's result is "
                "the same whatever the batch holds (aggdec.model.invariant), so that a lossless method gives its "
                "greedy's output at any batch size on a GPU too (cuBLAS's and SDPA's kernels change a row's last "
                "bits with the batch). auto: on a CUDA device for lossless methods. true: also on a CPU, under "
                "TRITON_INTERPRET=1 (slow: for tests). false: torch's kernels.", choices=("auto", True, False))

    def validate(self) -> None:
        super().validate()
        if self.compile is True and self.precision != "fp32":
            raise OptionError("compile", f"takes the fp32 verifier, not precision={self.precision}")
        if self.invariant is True and self.precision == "int8":
            raise OptionError("invariant", "has no int8 kernels; take precision fp32 or bf16")
        if self.invariant is True and self.compile is True:
            raise OptionError("invariant", "runs its kernels eagerly (or captured on a GPU); not with compile = true")


@dataclass(frozen=True, kw_only=True)
class AdaptiveDraft:
    """Mixin: the adaptive per-row draft length (aggdec.decoding.drafters.adapt_length)."""

    adaptive_draft: bool = option(False, "Per-row draft length that halves after a draft rejected in its first "
                                         "half and doubles after a fully accepted one (iad: needs draft_cap).")


@dataclass(frozen=True, kw_only=True)
class DraftModel:
    """Mixin: methods whose drafts come from a trained drafter model."""

    drafter: str | None = option(None, "Drafter directory: a draft head (gad, gad++) or proposal heads "
                                       "(blockwise), trained for this verifier.", path=True)
    block_size: int = option(10, "Draft block size k: tokens per draft (gad, gad++: at most the head's); "
                                 "blockwise: propose k-1 tokens with the first k-1 heads.", low=1)
    min_block: int = option(0, "Always keep the first min_block drafted tokens (Stern et al. 5.3; approximate, "
                               "lossy; 0: off).", low=0)

    def validate(self) -> None:
        super().validate()
        if not self.drafter:
            raise OptionError("drafter", f"method {self.method!r} needs a drafter (a draft-head or proposal-heads "
                                         "directory)")


def choice_text(choice: str | bool) -> str:
    """An option's choice as TOML and the command line spell it (true, false; strings as they are)."""
    return str(choice).lower() if isinstance(choice, bool) else choice


def option_fields(cls: type[DecodeOptions]) -> dict[str, dataclasses.Field]:
    """{name: field} of an options class, common fields last."""
    own = [f for f in dataclasses.fields(cls) if f.name not in _COMMON]
    return {f.name: f for f in own + list(_COMMON.values())}


_COMMON = {f.name: f for f in dataclasses.fields(DecodeOptions)}


def coerce(name: str, value: Any, hint: Any) -> Any:
    """`value`, as read from TOML or the command line, as type `hint` (int, float, bool, str, or a union of
    them, X | None among them): ints widen to float, whole floats narrow to int, "true"/"false" become
    bools, none/null mean None. Raises OptionError naming `name` when the value does not fit."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    optional = type(None) in args
    bases = tuple(a for a in args if a is not type(None))
    if optional and value in (None, "none", "None", "null"):
        return None
    if float in bases and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if int in bases and isinstance(value, float) and value.is_integer():
        return int(value)
    if bool in bases and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bases) or (bool not in bases and isinstance(value, bool)):
        kinds = " or ".join(b.__name__ for b in bases)
        raise OptionError(name, f"must be {kinds}{' or none' if optional else ''}, got {value!r}")
    return value


def type_hints(cls: type) -> dict[str, Any]:
    """Resolved type hints of a dataclass (annotations are strings under `from __future__`)."""
    return typing.get_type_hints(cls)


def output_options(opts: DecodeOptions) -> dict[str, Any]:
    """Everything that can change the output of `opts`: the package version, the method, its
    acceptance rule (draft -> verify methods) and every option not marked output=False."""
    out: dict[str, Any] = {"aggdec": package_version("aggdec"), "method": opts.method}
    if opts.draft_verify:
        out["accept"] = opts.acceptance().describe()
    out.update({name: getattr(opts, name) for name, f in option_fields(type(opts)).items()
                if f.metadata.get("output", True)})
    return out


def signature(opts: DecodeOptions, sha: str = "") -> str:
    """`output_options` as one string, plus the checkpoint's hash when given."""
    return "|".join([f"{k}:{v}" for k, v in output_options(opts).items()] + ([f"ckpt:{sha}"] if sha else []))

"""How a model frames a sentence with special tokens: source prefix and suffix, the decoder's start
token and the tokens forced at the start of every output.

fairseq and the project's own models: source = text + [eos], the decoder starts from eos, nothing is
forced. Imported Hugging Face families (aggdec.hf_import) differ: BART puts bos before the source and
forces bos first; Marian starts the decoder from pad; M2M100/NLLB and mBART frame the source with a
source-language token and start or force the target-language token. Language tokens are written
"source_lang" / "target_lang" in the lists below and resolved per job (`DecodeOptions.source_lang`,
`target_lang`) against `languages`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from aggdec.decoding.options import OptionError

Token = int | str  # a token id, or "source_lang" / "target_lang"
LANG_SLOTS = ("source_lang", "target_lang")


@dataclass(frozen=True)
class Framing:
    """Conventions resolved for one job: source = prefix + text ids + suffix; the decoder is fed
    `prompt[0]` first, and output tokens 0 .. len(prompt) - 2 are forced to prompt[1:]."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    prompt: tuple[int, ...]

    @property
    def start(self) -> int:
        return self.prompt[0]

    @property
    def forced(self) -> tuple[int, ...]:
        return self.prompt[1:]


@dataclass(frozen=True)
class Conventions:
    """A model's framing rules, stored as config.json's "conventions" (absent: fairseq's).

    decoder_start None means eos; source_suffix None means (eos,).
    """

    source_prefix: tuple[Token, ...] = ()
    source_suffix: tuple[Token, ...] | None = None
    decoder_start: Token | None = None
    forced: tuple[Token, ...] = ()
    languages: dict[str, int] = field(default_factory=dict)
    source_lang: str | None = None  # defaults when a job names none
    target_lang: str | None = None

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "Conventions":
        """Validated; errors start with `where` and name the field."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"{where}: unknown conventions fields {sorted(unknown)}")
        out = {}
        for name, value in d.items():
            if name in ("source_prefix", "source_suffix", "forced") and value is not None:
                if not isinstance(value, list) or not all(_is_token(t) for t in value):
                    raise ValueError(f"{where}: conventions.{name}: must be a list of token ids or {LANG_SLOTS}")
                value = tuple(value)
            elif name == "decoder_start" and value is not None and not _is_token(value):
                raise ValueError(f"{where}: conventions.decoder_start: must be a token id or {LANG_SLOTS}")
            elif name == "languages" and not (isinstance(value, dict) and all(
                    isinstance(k, str) and isinstance(v, int) for k, v in value.items())):
                raise ValueError(f"{where}: conventions.languages: must map language codes to token ids")
            out[name] = value
        return cls(**out)

    def resolve(self, eos: int, source_lang: str | None = None, target_lang: str | None = None) -> Framing:
        """The framing for a job. Raises OptionError naming source_lang / target_lang when the model
        needs a language it was not given, or was given one it does not know."""
        langs = {"source_lang": source_lang or self.source_lang, "target_lang": target_lang or self.target_lang}
        used = {t for t in (*self.source_prefix, *(self.source_suffix or ()), self.decoder_start, *self.forced)
                if isinstance(t, str)}
        for slot in LANG_SLOTS:
            code = langs[slot]
            if slot in used and code is None:
                raise OptionError(slot, f"this model needs one; its languages: {_listing(self.languages)}")
            if code is not None and slot in used and code not in self.languages:
                raise OptionError(slot, f"{code!r} is not a language of this model; its languages: "
                                        f"{_listing(self.languages)}")

        def ids(tokens) -> tuple[int, ...]:
            return tuple(self.languages[langs[t]] if isinstance(t, str) else t for t in tokens)

        start = eos if self.decoder_start is None else ids((self.decoder_start,))[0]
        suffix = (eos,) if self.source_suffix is None else ids(self.source_suffix)
        return Framing(prefix=ids(self.source_prefix), suffix=suffix, prompt=(start, *ids(self.forced)))


def _is_token(t) -> bool:
    return (isinstance(t, int) and not isinstance(t, bool) and t >= 0) or t in LANG_SLOTS


def _listing(languages: dict[str, int]) -> str:
    codes = sorted(languages)
    return ", ".join(codes[:12]) + (f" ... ({len(codes)} in all)" if len(codes) > 12 else "") if codes else "none"

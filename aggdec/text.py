"""Input text hygiene: what reaches a tokenizer is valid, printable UTF-8."""

from __future__ import annotations

import re
import unicodedata

_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: object) -> str:
    """Return `text` as a single line of valid UTF-8 with control characters turned into spaces.

    Lone surrogates (invalid in UTF-8) become U+FFFD; None becomes "". Whitespace runs collapse.
    """
    if text is None:
        return ""
    if not isinstance(text, str):
        text = str(text)
    text = _SURROGATE.sub("\ufffd", text)
    text = "".join(" " if unicodedata.category(c) == "Cc" else c for c in text)
    return " ".join(text.split())



def lost_characters(text: str, round_trip: str) -> list[str]:
    """The characters of `text` that `round_trip` (its tokens decoded again) lacks, in order of first
    appearance: what a tokenizer drops or turns into an unknown piece, so that the model never sees
    it (U+FFFD aside: bytes that were not text, said where they are read). Both sides are compared in
    NFKC, so a tokenizer's own normalization (full-width letters, ligatures) and whitespace are not
    losses; format characters (category Cf: bidirectional marks, zero-width joiners) are, where the
    tokenizer drops them."""
    kept = set(unicodedata.normalize("NFKC", round_trip))
    lost = dict.fromkeys(c for c in unicodedata.normalize("NFKC", text)
                         if not c.isspace() and c != "\ufffd" and c not in kept)
    return list(lost)


def name_characters(chars: list[str], most: int = 5) -> str:
    """`chars` by code point and name ("U+200F RIGHT-TO-LEFT MARK, ..."), at most `most` of them."""
    named = [f"U+{ord(c):04X} {unicodedata.name(c, 'unnamed')}" for c in chars[:most]]
    return ", ".join(named) + (f" and {len(chars) - most} more" if len(chars) > most else "")

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


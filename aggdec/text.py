"""Input text hygiene: what reaches a tokenizer is valid, printable UTF-8."""

from __future__ import annotations

import unicodedata


def clean_text(text: object) -> str:
    """Return `text` as a single line of valid UTF-8 with control characters turned into spaces.

    Lone surrogates (invalid in UTF-8) become U+FFFD; None becomes "". Whitespace runs collapse.
    """
    if text is None:
        return ""
    if not isinstance(text, str):
        text = str(text)
    text = text.encode("utf-8", "replace").decode("utf-8") if _has_surrogates(text) else text
    text = "".join(" " if unicodedata.category(c) == "Cc" else c for c in text)
    return " ".join(text.split())


def _has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False

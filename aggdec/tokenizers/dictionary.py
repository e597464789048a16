"""fairseq's `dict.txt` vocabulary: <s>=0, <pad>=1, </s>=2, <unk>=3, then one `symbol count` per line."""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
UNK = 3


class Dictionary:
    def __init__(self, symbols: list[str]):
        if symbols[:4] != SPECIALS:
            raise ValueError(f"a dictionary must start with {SPECIALS}")
        self.symbols = symbols
        # A symbol listed twice (allowed by fairseq only with `#fairseq:overwrite`) maps to its last id.
        self._index = {s: i for i, s in enumerate(symbols)}

    @classmethod
    def load(cls, path: str | Path) -> "Dictionary":
        """Read a fairseq dict file; errors name the file and line."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"dictionary not found: {path}")
        symbols = list(SPECIALS)
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                parts = line.rsplit(" ", 1)
                if parts[-1] == "#fairseq:overwrite":
                    parts = parts[0].rsplit(" ", 1)
                if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
                    raise ValueError(f"{path}:{n}: expected '<symbol> <count>', got {line!r}")
                symbols.append(parts[0])
        return cls(symbols)

    def save(self, path: str | Path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for s in self.symbols[4:]:
                f.write(f"{s} 1\n")

    def __len__(self) -> int:
        return len(self.symbols)

    def index(self, symbol: str) -> int:
        return self._index.get(symbol, UNK)

    def symbols_of(self, ids: list[int]) -> list[str]:
        return [self.symbols[i] for i in ids if i not in (0, 1, 2)]

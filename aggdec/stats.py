"""Additive decoding statistics: per-sentence rows merge into corpus totals (sacrebleu-style: collect
counts first, derive ratios last), so shards and actors can be merged exactly."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from aggdec.decoding.metadata import RowStats


@dataclass
class SpeedupStats:
    """Sums over sentences. Ratios are properties, never stored."""

    sentences: int = 0
    iterations: int = 0  # verifier calls, summed over sentences
    drafted: int = 0
    accepted: int = 0
    output_tokens: int = 0  # generated tokens incl. eos
    decode_ms: float = 0.0

    def add(self, row: RowStats, output_tokens: int) -> None:
        self.sentences += 1
        self.iterations += row.iterations
        self.drafted += row.drafted
        self.accepted += row.accepted
        self.output_tokens += output_tokens
        self.decode_ms += row.decode_ms

    def merge(self, other: "SpeedupStats") -> "SpeedupStats":
        return SpeedupStats(**{k: getattr(self, k) + getattr(other, k) for k in asdict(self)})

    @property
    def mean_accepted_per_iter(self) -> float:
        """Draft tokens accepted per verifier call (the bonus token not counted)."""
        return self.accepted / self.iterations if self.iterations else 0.0

    @property
    def tokens_per_iter(self) -> float:
        """Output tokens per verifier call: 1.0 for greedy."""
        return self.output_tokens / self.iterations if self.iterations else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(mean_accepted_per_iter=self.mean_accepted_per_iter, tokens_per_iter=self.tokens_per_iter,
                 acceptance_rate=self.acceptance_rate)
        return d

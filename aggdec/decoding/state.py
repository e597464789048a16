"""The batch of active rows that the draft -> verify loop works on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aggdec.decoding.metadata import Request
from aggdec.model.slots import SlotCache


@dataclass
class DecodeState:
    """The loop's rows ("slots"). All tensors have B rows on the model's device.

    src:     (B, S) int64 source ids incl. final eos, right-padded with pad; src_len (B,) int64.
    out:     (B, Lo) int64 decoder inputs: out[b, :stride] = the decoder start (eos for fairseq; the pair
             (bos, start) for a double-token model), then generated tokens.
    out_len: (B,) int64; out[b, :out_len[b]] is valid. Generated tokens so far: out_len - stride.
    max_len: (B,) int64; the token at output index max_len is forced to eos.
    cache:   the verifier's slot cache; every decoder input but the last step's has been fed.
    requests: host-side, the request each slot holds (None: empty). pad, eos: special ids.
    stride:  tokens the verifier emits per step: 1, or 2 for a double-token model (aggdec.double_token),
             whose generated tokens are a folded stream of (head, tail) pairs.
    index:   (B,) int64, the `Request.index` each slot holds (any for an empty slot), on the device.
    """

    src: torch.Tensor
    src_len: torch.Tensor
    out: torch.Tensor
    out_len: torch.Tensor
    max_len: torch.Tensor
    cache: SlotCache
    requests: list[Request | None]
    pad: int
    eos: int
    stride: int = 1
    index: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.out_len.shape[0]

    @property
    def generated(self) -> torch.Tensor:
        """(B,) number of generated tokens per row."""
        return self.out_len - self.stride

    def last_tokens(self) -> torch.Tensor:
        """(B,) the last decoder input of each row (not yet fed to the verifier)."""
        return self.last_step()[:, -1]

    def last_step(self) -> torch.Tensor:
        """(B, stride) the decoder inputs of each row's last step (not yet fed to the verifier)."""
        offs = torch.arange(-self.stride, 0, device=self.out.device)
        return self.out.gather(1, self.out_len[:, None] + offs)

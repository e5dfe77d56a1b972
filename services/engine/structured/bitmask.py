"""The allowed-token bitmask of a step's grammar rows, built on the host and applied on the device.

Only rows with a grammar are filled (one bit per token, 32 tokens per int32 word); a step with
no grammar row builds nothing (`build_token_bitmask` returns None before touching xgrammar).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.services.engine.request import Request


@dataclass(slots=True)
class TokenBitmask:
    bitmask: torch.Tensor  # [num_rows, ceil(vocab / 32)] int32 on the logits' device, -1 = all allowed
    row_ids: list[int]  # the rows it constrains


def build_token_bitmask(requests: Sequence[Request], vocab_size: int, device: torch.device) -> TokenBitmask | None:
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return None
    import xgrammar as xgr

    host = xgr.allocate_token_bitmask(len(requests), vocab_size)
    for row in rows:
        grammar = requests[row].grammar
        assert grammar is not None
        grammar.fill_bitmask(host, row)
    if device.type == "cuda":
        bitmask = host.pin_memory().to(device, non_blocking=True)
    else:
        bitmask = host
    return TokenBitmask(bitmask, rows)


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """Disallowed tokens of the constrained rows get -inf, in place (fp32 logits)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, mask.bitmask, vocab_size=logits.shape[1], indices=mask.row_ids)

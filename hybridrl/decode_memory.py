"""How many rows the native engine decodes together in a device's memory: one rule for the engine, which sizes its
chunks by a GPU's free memory at generate time (rollout/native.py), and for the memory ledger, which plans them
(automap/ledger.py). A row holds its KV cache and its share of a decode step's logits and sampling."""
from __future__ import annotations

# Of a GPU's free memory at generate time, what one chunk of the native engine may take for its rows' KV cache and
# decode working set (the rest: hidden states, the allocator's fragmentation)
KV_SHARE_OF_FREE = 0.9
# A decode step's logits and sampling, per row and vocabulary entry, at their peak: the model's logits, their fp32
# copy and log-probs, top-p's sorted values (fp32) and order (int64), the fp64 CDF the sampler searches
DECODE_BYTES_PER_LOGIT = 40


def decode_rows(cap: int, free_bytes: float | None, row_bytes: float) -> int:
    """Rows the native engine decodes together: `cap` (rollout.max_batch_size), or fewer where `free_bytes` (a GPU's
    free memory; None: a CPU, no limit but the cap) holds fewer rows of `row_bytes` each (KV cache and decode
    working set: `decode_row_bytes`); at least one (whether one fits is the ledger's verdict)."""
    if free_bytes is None:
        return cap
    return max(1, min(cap, int(free_bytes * KV_SHARE_OF_FREE // row_bytes)))


def decode_row_bytes(kv_bytes: float, vocab: int) -> float:
    """What one decoding row holds: its KV cache and its share of a decode step's logits and sampling."""
    return kv_bytes + vocab * DECODE_BYTES_PER_LOGIT

"""Training data: JSONL text, token ids and chat turned into packed, masked, resumable batches.

    from qwen35_jax.data import open_batches
    with open_batches("data/", seq_len=2048, batch_size=8, vocab_size=cfg.vocab_size) as stream:
        batch = stream.next_batch()  # {"tokens", "segment_ids", "loss_mask"}: int32 [B/n, S]

See docs/data.md for the input formats, masks, packing and the prepared-dataset layout.
"""

from qwen35_jax.data.batches import BatchStream, open_batches

__all__ = ["BatchStream", "open_batches"]

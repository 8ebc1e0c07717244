"""One model call across tensor-parallel ranks: what rank 0 sends of its eager step (`step_payload`) and how a
worker repeats it on its shard (`serve_worker`), through the control group of engine/distributed.py."""

from __future__ import annotations

from typing import Any

import torch

from .attention import AttentionMetadata
from .distributed import TPGroup


def step_payload(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, sample_rows: list[int]
) -> dict[str, Any]:
    """What a worker needs to repeat rank 0's eager model call on its shard (host tensors: the control group is
    gloo whatever the device)."""

    def host(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.cpu()

    return {
        "input_ids": host(input_ids),
        "positions": host(positions),
        "sample_rows": sample_rows,
        "prefill_info": host(meta.prefill_info),
        "prefill_block_tables": host(meta.prefill_block_tables),
        "slot_mapping": host(meta.slot_mapping),
        "decode_block_tables": host(meta.decode_block_tables),
        "decode_ctx_lens": host(meta.decode_ctx_lens),
        "prefill_rows": meta.prefill_rows,
    }


def serve_worker(group: TPGroup, model: torch.nn.Module, kv_cache: Any, device: str) -> None:
    """A worker's life after READY: run each model call rank 0 broadcasts, until it says stop."""
    dev = torch.device(device)
    with torch.inference_mode():
        while True:
            msg = group.receive_step()
            if msg is None:
                return

            def on(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else t.to(dev)

            meta = AttentionMetadata(
                prefill_info=on(msg["prefill_info"]),  # type: ignore[arg-type]
                prefill_block_tables=on(msg["prefill_block_tables"]),  # type: ignore[arg-type]
                kv_cache=kv_cache,
                slot_mapping=on(msg["slot_mapping"]),
                decode_block_tables=on(msg["decode_block_tables"]),
                decode_ctx_lens=on(msg["decode_ctx_lens"]),
                prefill_rows=msg["prefill_rows"],
            )
            hidden = model(on(msg["input_ids"]), on(msg["positions"]), meta)
            rows = msg["sample_rows"]
            if rows:
                model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=dev)])  # type: ignore[operator]

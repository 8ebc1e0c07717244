"""One rank of the tensor-parallel math check (tests/test_tensor_parallel.py): builds every case's shard of a tiny
model, runs a prompt through it over gloo, and rank 0 writes the logits. Also imported by the test for the same
cases at TP=1 (shard=SINGLE), so both sides build their model the same way."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from glowplug.engine.attention import AttentionMetadata
from glowplug.engine.models.arch import load_arch
from glowplug.engine.models.llama import DecoderLM
from glowplug.engine.models.loader import (
    build_meta_model,
    check_state_dict,
    fuse_checkpoint,
    materialize,
    read_checkpoint,
)
from glowplug.engine.parallel import TPShard, shard_checkpoint
from glowplug.kernels.dispatch import Dispatcher, DispatchTable
from glowplug.kernels.modules import QuantLinear
from glowplug.kernels.registry import get_scheme

IDS = [3, 17, 250, 5, 99, 311, 42, 8, 160, 7, 1, 300]


def build(model_dir: Path, shard: TPShard, scheme: str, group_size: int | None) -> DecoderLM:
    """The shard of the model that the start-up stages build (load_weights -> quantize_weights -> model_init)."""
    arch = load_arch(model_dir)
    checked = check_state_dict(build_meta_model(arch), dict(read_checkpoint(model_dir).state_dict), model_dir)
    sd = fuse_checkpoint(shard_checkpoint(checked, arch, shard))
    model = build_meta_model(arch, shard)
    keep: frozenset[str] = frozenset()
    if scheme != "none":
        if "lm_head.weight" not in sd:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        s = get_scheme(scheme)
        merged = s.quantize_state_dict(sd, group_size=group_size, quantize_head=True)
        sd = {k: v for k, v in sd.items() if not (k.endswith(".weight") and k.rsplit(".", 1)[0] + ".qweight" in merged)}
        sd.update({k: v for k, v in merged.items() if k not in sd})
        model.untie_head_for_quantization()
        # The fp32 reference kernel (de-quantize, then F.linear): the stock CPU kernels multiply in bf16, whose
        # rounding of each rank's partial sum would blur the comparison of the split itself.
        kinds = ("int8_channel", "int8_group", "int4", "int2", "w8a8")
        exact = Dispatcher(DispatchTable(rules={f"cpu/{k}": [(None, "reference")] for k in kinds}))
        s.convert_for_runtime(model, group_size=group_size, quantize_head=True, dispatcher=exact)
        keep = frozenset(
            f"{n}.{b}"
            for n, m in model.named_modules()
            if isinstance(m, QuantLinear)
            for b, _ in m.named_buffers(recurse=False)
        )
    materialize(model, sd, torch.float32, "cpu", model_dir, keep_dtype=keep)
    model.model.build_rope(arch.max_position_embeddings, "cpu")
    return model


def logits(model: DecoderLM) -> torch.Tensor:
    with torch.inference_mode():
        h = model(torch.tensor(IDS), torch.arange(len(IDS)), AttentionMetadata.causal([len(IDS)]))
        return model.compute_logits(h)


def main() -> None:
    import torch.distributed as dist

    rank, world, rendezvous, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    cases = [c.split(":") for c in sys.argv[5:]]  # name:dir:scheme:group
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    results = {}
    for name, d, scheme, group in cases:
        model = build(Path(d), TPShard(rank, world), scheme, int(group) if group != "-" else None)
        results[name] = logits(model)
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

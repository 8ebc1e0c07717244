"""One artifact store for every glowplug cache: store.py (layout, atomic writes, self-healing, miss explanations),
workspace.py (entries another tool fills in place), cachedir.py (an unusable cache dir, cache events),
manifest.py (manifests and checksums), caches.py (the caches, their factors and their unusable-dir choices),
admin.py (`glowplug cache ls | verify | prune`).

The checksum choice, measured on the real SmolLM2 files (reports/cache-verify.md, `glowplug bench cache-verify`;
2-core AMD EPYC, page cache warm, median of 7 runs):

| what is checked                                   | quick (default) | full (sha256 of every byte) |
|---------------------------------------------------|-----------------|-----------------------------|
| the converted-model entry, 541.6 MB, 5 files      | 2.8 ms          | 529 ms                      |
| of which model.safetensors, 538.1 MB              | 0.03 ms (header)| 533 ms                      |
| the Inductor cache, 2.9 MB, 29 files              | 2.6 ms (whole)  | 2.4 ms                      |

A warm start of the default model takes 5.7 s (reports/startup/startup.md), so a full check on every hit would
add about 9 % to it and the quick one under 0.1 %. Quick is the default: sizes catch truncated, emptied and
missing files, whole-file hashes cover every file up to 8 MiB (JSON, tokenizer, Inductor kernels), and the header
hash covers a large safetensors file's names, dtypes, shapes and offsets. What it cannot see is a flipped bit
inside a large file's tensor data; `glowplug cache verify --full`, or GLOWPLUG_CACHE_VERIFY=full for every start,
hashes every byte. The GGUF source of the model cache is keyed by name, size and mtime, not hashed: its sha256
takes 102 ms per start (same report).
"""

from .cachedir import CacheDirUnusable
from .store import ArtifactStore, CacheSpec, Fetched
from .workspace import Workspace

__all__ = ["ArtifactStore", "CacheDirUnusable", "CacheSpec", "Fetched", "Workspace"]

"""One artifact store for every glowplug cache (see store.py for the layout and guarantees, caches.py for the
caches and their unusable-dir choices, manifest.py for the checksums)."""

from .store import ArtifactStore, CacheDirUnusable, CacheSpec, Fetched, Workspace

__all__ = ["ArtifactStore", "CacheDirUnusable", "CacheSpec", "Fetched", "Workspace"]

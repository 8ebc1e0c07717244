"""Quality flags: a quantization whose perplexity is more than QUALITY_LIMIT x bf16's is marked in every table it
appears in, so no speed figure of a broken format (int2 measured a perplexity of 5e5) reads as a usable result.

`glowplug bench accuracy --out F.md` writes F.json next to its Markdown with the perplexities; the speed benchmarks
take `--quality-from F.json` and mark each flagged scheme's rows. `glowplug bench all` runs accuracy first and
passes its file to every later report. Pure Python: the CLI imports this module while building its parser.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

QUALITY_LIMIT = 2.0
REFERENCE = "none"


def flags_from_perplexity(perplexity: Mapping[str, float], reference: float) -> dict[str, str]:
    """scheme -> the mark its rows carry, for every scheme above QUALITY_LIMIT x the bf16 perplexity."""
    out: dict[str, str] = {}
    for scheme, ppl in perplexity.items():
        if scheme != REFERENCE and reference > 0 and ppl > QUALITY_LIMIT * reference:
            out[scheme] = f"⚠ unusable: perplexity {ppl:.3g} = {ppl / reference:.3g}x bf16's"
    return out


def quality_dict(perplexity: Mapping[str, float], reference: float) -> dict[str, Any]:
    return {
        "reference": REFERENCE,
        "reference_perplexity": reference,
        "limit_x": QUALITY_LIMIT,
        "perplexity": dict(perplexity),
        "flags": flags_from_perplexity(perplexity, reference),
    }


def load_flags(path: Path | None) -> dict[str, str]:
    """The flags of an accuracy JSON (none without a file: a benchmark run alone cannot judge quality)."""
    if path is None:
        return {}
    data = json.loads(Path(path).read_text())
    return flags_from_perplexity(data["perplexity"], float(data["reference_perplexity"]))


def flag_note(flags: Mapping[str, str]) -> str:
    """The sentence under a table that carries flags."""
    if not flags:
        return ""
    return (
        f"⚠ marks a scheme whose perplexity is more than {QUALITY_LIMIT:g}x bf16's (accuracy report): "
        + "; ".join(f"{k}: {v.removeprefix('⚠ unusable: ')}" for k, v in sorted(flags.items()))
        + "."
    )

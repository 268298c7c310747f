"""Provider binary versions: dotted numeric comparison (domain §2.8, §7.2), memoised per string."""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4096)
def version_key(version: str) -> tuple[int, ...]:
    """'v0.7.5-rc1' → (0, 7, 5). A leading 'v' is tolerated; suffixes after '-' or '+' are
    dropped; an unparseable component counts as 0; trailing zeros are trimmed so that missing
    components compare as 0."""
    v = version.strip()
    if v[:1] in ("v", "V"):
        v = v[1:]
    for sep in "-+":
        v = v.split(sep, 1)[0]
    parts = []
    for piece in v.split("."):
        digits = ""
        for ch in piece.strip():
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits[:18]) if digits else 0)
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def compare_versions(a: str, b: str) -> int:
    ka, kb = version_key(a), version_key(b)
    return (ka > kb) - (ka < kb)


def at_or_above(version: str, floor: str) -> bool:
    """True when a floor is set, the version is reported, and version ≥ floor."""
    return bool(floor) and bool(version) and compare_versions(version, floor) >= 0

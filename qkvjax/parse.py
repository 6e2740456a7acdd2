"""Option texts as values: the one boolean spelling shared by ``--config.*`` overrides and layer patterns."""

from __future__ import annotations

BOOLEAN_SPELLINGS = {True: ("true", "yes", "1"), False: ("false", "no", "0")}  # any case


def parse_bool(raw: str) -> bool:
    """``raw`` as a boolean (``BOOLEAN_SPELLINGS``, any case); ValueError naming it and what is allowed."""
    for value, spellings in BOOLEAN_SPELLINGS.items():
        if raw.lower() in spellings:
            return value
    raise ValueError(
        f"{raw!r} is not a boolean; allowed: {', '.join(BOOLEAN_SPELLINGS[True] + BOOLEAN_SPELLINGS[False])}"
    )

"""How many examples a property test draws: `quick` by default, `thorough` under the thorough
hypothesis profile (tests/conftest.py). Read when a test module is imported, after the profile is
loaded (conftest.py first, then pytest's --hypothesis-profile, then the test modules)."""

from __future__ import annotations

from hypothesis import settings


def examples(quick: int, thorough: int) -> int:
    return thorough if settings.get_current_profile_name() == "thorough" else quick

"""Every case of the probe, from the generators of each family (the tests draw theirs from here too)."""

from __future__ import annotations

from cases_api import all_api_cases
from cases_env import all_env_cases
from cases_observer import all_observer_cases
from cases_read import all_read_cases
from cases_run import all_run_cases
from harness import Case


def all_cases() -> list[Case]:
    cs = [*all_read_cases(), *all_run_cases(), *all_api_cases(), *all_env_cases(), *all_observer_cases()]
    ids = [c.id for c in cs]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"case ids used twice: {dup}")
    return cs

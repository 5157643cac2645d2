"""The cause facts, one call per module: what a rule needs to say why, not only how often."""

from __future__ import annotations

from typing import Any

import pandas as pd

from vlmdoctor.trace import attention_cause, casts
from vlmdoctor.trace.optime import op_tree
from vlmdoctor.trace.tables import Tables


def cause_facts(t: Tables, ctx: pd.DataFrame, facts: dict[str, Any], n: int) -> dict[str, Any]:
    """Written-out attention by kind (trace/attention_cause.py) and casts by kind (trace/casts.py): each module's
    function read off the module at the call, as the driver calls every family."""
    tree = op_tree(t, ctx)
    out = attention_cause.attention_cause_facts(t, ctx, tree, n)
    if tree.gpu:  # a CPU run's casts are cpu.cast.* (trace/cpu_facts.py), weighed against its own bf16 rate
        out.update(casts.cast_facts(t, ctx, tree, n))
    return out

"""The cause facts, one call per module: what a rule needs to say why, not only how often."""

from __future__ import annotations

from typing import Any

import pandas as pd

from vlmdoctor.trace.tables import Tables


def cause_facts(t: Tables, ctx: pd.DataFrame, facts: dict[str, Any], n: int) -> dict[str, Any]:
    """Written-out attention by kind (trace/attention_cause.py) and casts by kind (trace/casts.py)."""
    from vlmdoctor.trace.attention_cause import attention_cause_facts
    from vlmdoctor.trace.casts import cast_facts
    from vlmdoctor.trace.optime import op_tree

    tree = op_tree(t, ctx)
    out = attention_cause_facts(t, ctx, tree, n)
    if tree.gpu:  # a CPU run's casts are cpu.cast.* (trace/cpu_facts.py), weighed against its own bf16 rate
        out.update(cast_facts(t, ctx, tree, n))
    return out

"""The loss: the logits tensor's size and dtype, and the rows the LM head and loss ran on (or, under Liger's
fused linear cross entropy, the logits it never materializes)."""

from __future__ import annotations

from typing import Any

import numpy as np

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import Reading, token_batches
from vlmdoctor.trace.tables import FCE_OP, LOGITS_OPS

PRODUCES = by_producer(__name__)
DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8}


def produce(r: Reading, facts: dict[str, Any]) -> None:
    t, n = r.t, r.n
    logits = [(name, d[0]) for _, name, d in t.shapes if name in LOGITS_OPS and d and d[0]]
    if logits:
        token_shapes = token_batches(t)
        name, dims = max(logits, key=lambda x: int(np.prod(x[1])))
        tp = (t.types.get(name) or ["float"])[0]
        facts["loss.logits_elements"] = int(np.prod(dims))
        facts["loss.logits_gb"] = int(np.prod(dims)) * DTYPE_BYTES.get(tp, 4) / 2**30
        facts["loss.logits_dtype"] = tp
        ce = [d[0] for _, name, d in t.shapes if name == "aten::cross_entropy_loss" and d and len(d[0]) == 2]
        tokens = sum(int(np.prod(b)) for b in token_shapes) if token_shapes else 0
        if ce and tokens:  # rows the LM head and loss ran on, against the positions of the token batches
            facts["loss.head_rows_per_step"] = sum(d[0] for d in ce) / n
            facts["loss.head_rows_frac"] = sum(d[0] for d in ce) / tokens
    fce = [d for _, name, d in t.shapes if name == FCE_OP and d and len(d) >= 2 and len(d[0]) == 2 and len(d[1]) == 2]
    if fce:  # the rows x vocabulary that plain cross entropy would hold as logits: what turning FusedCE off costs
        facts["loss.fce_logits_elements"] = max(int(d[0][0]) * int(d[1][0]) for d in fce)

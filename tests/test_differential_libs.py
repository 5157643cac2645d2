"""The differential corpus's scripts that train through a library (the Trainer, peft's LoRA, DDP under torchrun,
torch.compile): the same test as tests/test_differential.py, in a file of its own so that pytest-xdist runs the
two halves of the corpus on its two workers."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_differential import Case, params, same_under_every_way_in


@pytest.mark.parametrize("case", params(libraries=True))
def test_a_librarys_training_is_the_same_under_every_way_in(case: Case, tmp_path: Path) -> None:
    same_under_every_way_in(case, tmp_path)

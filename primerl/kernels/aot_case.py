"""One AOT compile case (:class:`Case`): what :mod:`.aot` compiles and the case lists
(:mod:`.aot_cases`, ``sparse_attention/aot_cases.py``, a ``--extra`` file) define. On its own so
that the case lists do not import the compiler module that loads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class Case:
    """A call of one launcher at one shape. ``run`` builds its inputs itself (it runs under
    storage-less tensors on device "cuda") and launches; ``mma`` is "fp8", "bf16" or None."""

    name: str
    run: Callable[[], object]
    mma: str | None
    ci: bool = False  # in the subset the test suite compiles

"""Compatibility names: the job's entry points now live with their processes.

- ``trainer_main``: ``primerl.runtime.trainer.main`` (``primerl trainer``)
- ``orchestrator_main``: ``primerl.runtime.orchestrator.main`` (``primerl orchestrator``)
- ``make_client`` / ``make_pool_client`` / ``make_pd_client``: ``primerl.runtime.orchestrator.clients``
- ``run_threads`` (the whole job in one process): ``primerl.runtime.launch.threads``
- ``run_rl`` and the launcher's helpers: ``primerl.runtime.launch.machine``

What runs where: ``primerl.runtime.launch``'s docstring.
"""

from __future__ import annotations

from .launch.common import JobFailed, prepare_output, start_step  # noqa: F401 (re-exported)
from .launch.machine import first_failure, launched_vllm, run_rl  # noqa: F401 (re-exported)
from .launch.threads import run_threads  # noqa: F401 (re-exported)
from .lifetime import setup_logging  # noqa: F401 (re-exported)
from .orchestrator.clients import make_client, make_pd_client, make_pool_client  # noqa: F401 (re-exported)
from .orchestrator.main import _exit_past_receiver, orchestrator_main  # noqa: F401 (re-exported)
from .trainer.main import trainer_main  # noqa: F401 (re-exported)

__all__ = ["JobFailed", "first_failure", "launched_vllm", "make_client", "make_pd_client", "make_pool_client",
           "orchestrator_main", "prepare_output", "run_rl", "run_threads", "start_step", "trainer_main"]

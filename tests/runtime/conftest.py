"""Runtime tests run tiny models where thread start-up dominates: one intra-op thread is faster
and keeps the 2-core machine usable for the job's own processes."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

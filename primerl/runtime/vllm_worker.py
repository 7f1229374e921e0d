"""Compatibility path: the vLLM worker extension now lives in ``primerl.runtime.inference.vllm_worker``.

Servers started with ``--worker-extension-cls primerl.runtime.vllm_worker.WeightUpdateExtension``
(before the runtime was split into rooms) keep working; new launches name the new path.
"""

from .inference.vllm_worker import WeightUpdateExtension, checkpoint_tensor_names, load_in_place  # noqa: F401
from .inference.weight_broadcast import (new_group, receive_update, receive_weights, send_update,  # noqa: F401
                                         send_weights, weight_specs)

__all__ = ["WeightUpdateExtension", "checkpoint_tensor_names", "load_in_place", "new_group", "receive_update",
           "receive_weights", "send_update", "send_weights", "weight_specs"]

"""primerl: kernel-first PyTorch library for asynchronous RL post-training of MoE language models.

Layers (an import never goes up a layer):
  primerl.kernels   -> ops on tensors (FP8, GEMM, MoE, attention, log-probs); reference + Triton + CUDA
  primerl.parallel  -> meshes, FSDP2, context/expert parallel on torch.distributed
  primerl.rl        -> advantages, policy losses, packing, environments
  primerl.models    -> the MoE transformer and Hugging Face checkpoints
  primerl.runtime   -> inference engine, orchestrator, trainer, the `primerl` command
"""

__version__ = "0.1.0"

"""Optional integrations with other libraries; each module imports its library lazily and is
only usable when that library is installed.

- :mod:`.transformers`: Auto-class registration of MoETransformer checkpoints.
- :mod:`.torchtitan`: ``swap_torchtitan_grouped_experts`` runs torchtitan's MoE grouped experts
  on primerl's bf16 / FP8 grouped GEMMs.
"""

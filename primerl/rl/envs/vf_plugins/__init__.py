"""verifiers plugins shipped with primerl, imported by verifiers under their top-level names.

verifiers 0.4.0 loads a taskset or harness by id as a top-level module (``primerl-vault`` ->
``primerl_vault``), as installed environment packages are; ``primerl.rl.envs.verifiers_env`` puts
this folder on ``sys.path`` (and ``PYTHONPATH``, for tool-server subprocesses). This file only
makes the folder part of the installed package; import the modules by their top-level names.

- ``primerl_inprocess``: the in-process chat/tool harness (no ``uv`` at run time).
- ``primerl_reverse_text``: single-turn reverse-text taskset.
- ``primerl_vault``: multi-turn tool-use taskset with an MCP toolset, and its ``vf.Env`` that answers a
  wrong reply as the user (so an episode is >= 2 model turns).
"""

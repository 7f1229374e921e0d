"""The inference side's error types, importable without torch (the launcher catches them)."""


class InferenceServerError(RuntimeError):
    """An inference server (vLLM, ``primerl inference``, a pool's router) failed to start, answered
    an error, or could not be reached."""


__all__ = ["InferenceServerError"]

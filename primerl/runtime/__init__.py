"""The async RL runtime: embedded inference engine, orchestrator, trainer, the primerl command."""

"""Layer 2: thin, composable RL modules: advantages, policy losses, packing, environments."""

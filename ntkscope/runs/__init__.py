"""Real models and training runs: model families, checkpoints, embeddings at named points, and the
analyses over a run's checkpoints."""

"""The shared core: input errors, memory, atomic files and caches, the LM loss. Imports nothing else of ntkscope."""

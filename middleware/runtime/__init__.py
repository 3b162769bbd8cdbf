"""Runtime: plans, buffers and the ``OptimizedModule`` handed back to the user."""

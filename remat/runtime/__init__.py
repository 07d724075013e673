"""The running half: one open chain (``ChainCall``), its stage calls, and the
execution of a plan in the backward through saved-tensor hooks, with RNG,
autocast and in-place state replayed."""

"""What every model of ``remat.models`` shares: opening its chain."""

import contextlib

__all__ = ["open_chain"]


def open_chain(model):
    """The context ``model``'s forward runs its stages in.

    The chain gets ``model.budget`` and ``model.algorithm`` (see
    ``remat.chain``); with ``model.budget`` None the stages run as plain
    PyTorch (no chain). The
    chain module is imported only when a budget is given, so building and
    running a model without one never touches the runtime.

    Call it directly in a ``with`` statement in the model's forward: the chain
    is keyed by the line of that ``with`` (see Note [Chain keys] in
    remat/chain.py).
    """
    if model.budget is None:
        return contextlib.nullcontext()
    from ..chain import chain
    return chain(budget=model.budget, algorithm=model.algorithm)

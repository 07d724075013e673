"""The exception family: every error remat raises is a ``RematError``."""

__all__ = [
    "RematError",
    "BudgetError",
    "CostsError",
    "InvalidScheduleError",
    "SolverError",
    "StageError",
    "RecomputeMismatchError",
    "UsageError",
]


class RematError(Exception):
    """Base class of every error raised by remat."""


class BudgetError(RematError, ValueError):
    """The memory budget is malformed or below what the chain needs.

    ``minimum`` is the least budget in bytes that would do (for the algorithm
    asked for), where the error is about one too small; else None."""

    def __init__(self, message, minimum=None):
        super().__init__(message)
        self.minimum = minimum

    def __reduce__(self):
        return type(self), (str(self), self.minimum)


class CostsError(RematError, ValueError):
    """A ``Costs`` record is malformed (names the field and the stage)."""


class InvalidScheduleError(RematError, ValueError):
    """A schedule breaks the op rules (a value used before it exists, ...)."""


class SolverError(RematError, RuntimeError):
    """The C solver refused the input or could not allocate its tables."""


class StageError(RematError, RuntimeError):
    """A stage or a chain was misused (names the stage and the fix)."""


class UsageError(RematError, TypeError, ValueError):
    """An argument of remat's API of the wrong type or value (the message names it
    and what to give): catchable as ``TypeError`` and ``ValueError`` too."""


class RecomputeMismatchError(RematError, RuntimeError):
    """A recomputation did not save what the first forward saved."""


def input_modified(index, name):
    """The StageError for stage ``index`` (``name``) writing its input in place."""
    return StageError(
        f"remat: stage {index} ({name}) modified its input in place (e.g. a ReLU(inplace=True) as "
        f"its first op); remat needs the input unchanged to recompute the stage. Make that op out of "
        f"place or move it to the end of " + (f"stage {index - 1}" if index > 1 else "the code before the chain"))


def not_handed_on(k, name, prev_name, skipped=None, again=None, hooks="", got=None, prev=None, given=None):
    """The StageError for stage ``k`` (``name``) not getting what stage k-1 returned:
    a stage called under no_grad in between (``skipped``, its name), the same block
    called again (``again``, the stage it first was) on a tensor not made from what
    stage k-1 returned (``got``, ``prev``: a second pass), or code between the two
    (``hooks``: a sentence on module hooks that run there, or ""), or another argument, which
    needs no grad (a mask), taken for the activation (``given``: the call's args, kwargs and
    the keyword it was taken as; one that needs grad may begin another chain, a decoder's)."""
    if again is not None and _made_from(got, prev):   # (a block reused in one pass, code between its calls)
        again = None
    if skipped is not None:
        return StageError(
            f"remat: a stage ({skipped}) was called under torch.no_grad() in the middle of a chain, after "
            f"stage {k - 1} ({prev_name}); the stages after it could not be recomputed from its output. "
            f"To freeze it, turn its parameters' requires_grad off (block.requires_grad_(False)) and call it "
            f"as usual, or close the chain before it")
    if again is not None:
        return StageError(
            f"remat: {name}, stage {again} of this chain, was called again as stage {k} on another tensor "
            f"than stage {k - 1} ({prev_name}) returned: a second pass over the blocks (a siamese tower, a "
            f"second view) starts its own chain. Open one remat.chain per pass (with remat.wrap, call the "
            f"wrapped model once per pass)")
    args, kwargs, in_kw = given if given is not None else ((), {}, None)
    where = next((f"as {key}=" for key, v in kwargs.items() if v is prev and key != in_kw), None) or \
        next((f"as its argument {i + 1}" for i, v in enumerate(args) if v is prev), None)
    if prev is not None and where is not None and not getattr(got, "requires_grad", True):   # (else a chain's input)
        return StageError(
            f"remat: stage {k} ({name}) got the tensor stage {k - 1} ({prev_name}) returned {where}, but took "
            f"{'its argument ' + in_kw if in_kw else 'an argument before it'} for the activation: a stage's "
            f"activation is its first tensor argument (the first positional one; else, of those passed by "
            f"keyword, the one whose parameter comes first in its signature). Pass the activation first, or "
            f"put its parameter first in the stage's signature")
    return StageError(
        f"remat: stage {k} ({name}) did not receive the tensor stage {k - 1} ({prev_name}) returned; code "
        f"between the two stages changed the activation. Move that code into stage {k - 1} or {k}, or make "
        f"it a stage of its own{hooks}")


def _made_from(t, source, nodes=256):
    """Whether autograd made tensor ``t`` from ``source`` (its graph, searched as far as
    ``nodes`` nodes, reaches ``source``'s node)."""
    target = getattr(source, "grad_fn", None)
    todo, seen = [getattr(t, "grad_fn", None)], set()
    while todo and target is not None and len(seen) < nodes:
        node = todo.pop()
        if node is None or node in seen:
            continue
        if node is target:
            return True
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
    return False


def backward_failed(call, exc):
    """Say why a stage's measured backward (run 2) raised ``exc``: a StageError for a
    reentrant checkpoint inside the stage, else a note on the exception."""
    if isinstance(exc, RuntimeError) and "use_reentrant=True" in str(exc):
        raise StageError(
            f"remat: stage {call.index} ({call.name}) runs torch.utils.checkpoint with "
            f"use_reentrant=True inside, whose backward cannot be run on one stage alone, as "
            f"remat's first call measures each stage. Pass use_reentrant=False (or drop the "
            f"checkpoint: remat decides what to recompute), or measure the costs once that way "
            f"and pass the file: remat.chain(..., costs=\"costs.json\")") from exc
    if hasattr(exc, "add_note") and not isinstance(exc, KeyboardInterrupt):
        exc.add_note(_BACKWARD_FAILED)


_BACKWARD_FAILED = (
    "(raised by the backward that remat's first call runs on each stage to measure it, inside "
    "the chain's forward: hooks that expect a backward only after the forward may reject it. "
    "Measure the costs once without them and pass the file: remat.chain(..., costs=\"costs.json\"))")


def tail_unseen(exc, seen):
    """``exc``, raised by a measuring call's plan, the tail as ``seen``; a ``BudgetError`` made
    before the tail's backward ran says that its minimum may be short of the chain's (3 of
    Note [The chain's tail], remat/measure/tail.py)."""
    if not isinstance(exc, BudgetError) or seen is None or seen.backward_peak is not None:
        return exc
    return BudgetError(f"{exc}. That minimum counts the head and loss after the chain as their forward showed "
                       f"them; their backward has not run yet and may need more, which the next call, at that "
                       f"budget, would find (and raise with its own minimum)", exc.minimum)

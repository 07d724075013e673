"""``Option``: another way to record a stage, which keeps less than a-bar^i and
pays for it in the stage's backward (docs/how-it-works.md, "Options").

Note [Options]
--------------
A stage's record, a-bar^i, is everything B(i) reads. Much of it is often cheap
to make again: the outputs of norms and activations next to the matmul outputs
they come from. An option of stage i is another ``Fall(i)`` that keeps only part
of the record (the matmul outputs, say); B(i) then first rebuilds the rest from
what was kept and from the stage input a^(i-1). A persistent schedule holds
a^(i-1) from ``Fall(i)`` until ``B(i)`` (rule 5 of Note [Accounting] in
remat/solver/schedule.py needs it there), so the rebuild always has its input:
an option changes what is held between ``Fall(i)`` and ``B(i)`` and what the
two ops cost, nothing else. This is how Rockmate extends rotor's dynamic
program (Zhao et al., ICML 2023).

1. Option 0 is the base record: the stage's own fields. Options 1..k are the
   ``Option`` entries of ``Costs.options[i-1]``: ``saved_bytes`` is what the
   option keeps, its a-bar^i (a^i included: later stages read a^i as before),
   ``fwd_time`` the recording forward that keeps it, ``bwd_time`` B(i) under it,
   the rebuild included, and ``fwd_tmp``/``bwd_tmp`` their transients as the
   base fields define them, relative to what the option holds (the rebuilt
   tensors are part of ``bwd_tmp``).
2. ``Fall(i, option=o)`` is rule 3 of Note [Accounting] with the option's
   saved_bytes, fwd_tmp and fwd_time; the ``B(i)`` that follows is rule 5 with
   the bwd_tmp and bwd_time of the option its a-bar^i was recorded with, and
   frees that option's saved_bytes. ``Fn(i)`` and ``Fck(i)`` keep no record:
   options do not change them.
3. What the forward phase lets go (rule 6). ``fwd_drop[i-1]`` says that stage
   i's base record keeps nothing of a^(i-1); an option's B(i) rebuilds from
   a^(i-1), so a ``Fall(i)`` with an option lets none of it go.
   ``fwd_drop_whole[i]`` also says that the base B(i) does not read a^i; an
   option keeps a^i and its B(i) may read it, so an a^i inside the a-bar^i of
   an option is not let go either. Both count what an option may need, never
   less than it needs: one that reads neither is planned as if it did.
4. The tail (``Costs.tail``) has no options: it runs once, as the caller runs it.
5. The solvers take the least over a stage's options wherever they record it
   (remat/solver/solve.py Note [The recurrence]). An option that keeps less than
   the base record lowers what recording the stage needs, and so maybe the
   chain's minimum; one that is slower and larger than another is never chosen.
"""

import collections.abc
from dataclasses import dataclass, fields

from ..errors import CostsError
from .checks import check_size, check_time, entries, where

__all__ = ["Option", "MAX_OPTIONS", "check_options"]

# Options a stage may list (the C solver's REMAT_MAX_OPTIONS, src_c/solver.h).
MAX_OPTIONS = 64


@dataclass(frozen=True)
class Option:
    """Another way to record a stage (Note [Options]): what it keeps and what it costs.

    Args:
        saved_bytes: what the stage holds after recording this way, its
            output a^i included (in place of ``Costs.saved_bytes[i]``).
        fwd_time: the recording forward that keeps it.
        bwd_time: the stage's backward under it, rebuilding what it did not keep.
        fwd_tmp: transient bytes of that forward, as ``Costs.fwd_tmp``.
        bwd_tmp: transient bytes of that backward, as ``Costs.bwd_tmp``
            (down to ``-out_bytes``).

    ``Costs`` checks the numbers (and names the stage and option of a bad one).

    Example:
        >>> from remat import Costs, Option
        >>> keep_less = Option(saved_bytes=120, fwd_time=1.0, bwd_time=2.5, fwd_tmp=0, bwd_tmp=40)
        >>> c = Costs.uniform(3, size=100, saved=300).with_options({2: [keep_less]})
        >>> c.options[1]
        (Option(saved_bytes=120, fwd_time=1.0, bwd_time=2.5, fwd_tmp=0, bwd_tmp=40),)
    """

    saved_bytes: int
    fwd_time: float
    bwd_time: float
    fwd_tmp: int
    bwd_tmp: int

    def to_dict(self):
        """A JSON-ready dict of its fields."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


_NAMES = tuple(f.name for f in fields(Option))


def check_options(raw, out_bytes, tail):
    """``Costs.options`` checked: a tuple with, per stage, a tuple of ``Option``
    (empty where the stage has none); None means none anywhere. Each option is
    an ``Option`` or a dict of its fields (as a costs file holds it)."""
    n = len(out_bytes)
    if raw is None:
        return ((),) * n
    checked = []
    for i, listed in enumerate(entries("options", raw, n)):
        if isinstance(listed, (Option, str, bytes, collections.abc.Mapping)) or not isinstance(
                listed, collections.abc.Iterable):
            raise CostsError(f"remat: {where('options', i)} must be a list of remat.Option (the stage's "
                             f"other ways to record it; [] for none), got {type(listed).__name__}")
        options = tuple(_option(i, q, o, out_bytes[i]) for q, o in enumerate(listed))
        if len(options) > MAX_OPTIONS:
            raise CostsError(f"remat: {where('options', i)} lists {len(options)} options; a stage may "
                             f"have at most {MAX_OPTIONS}")
        if options and tail and i == n - 1:
            raise CostsError(f"remat: {where('options', i)} lists options, but the last stage is the "
                             f"chain's tail (Costs.tail), which runs once as the caller runs it: give it []")
        checked.append(options)
    return tuple(checked)


def _option(i, q, raw, out):
    """Option ``q`` (0-based in the list) of stage i+1, checked as its Costs fields are."""
    if isinstance(raw, Option):
        values = raw.to_dict()
    elif isinstance(raw, collections.abc.Mapping) and set(raw) == set(_NAMES):
        values = raw
    else:
        got = sorted(map(str, raw)) if isinstance(raw, collections.abc.Mapping) else type(raw).__name__
        raise CostsError(f"remat: Costs.options[{i}][{q}] (stage {i + 1}, option {q + 1}) must be a "
                         f"remat.Option or a dict of exactly {list(_NAMES)}, got {got}")
    return Option(
        saved_bytes=check_size("saved_bytes", i, values["saved_bytes"], option=q),
        fwd_time=check_time("fwd_time", i, values["fwd_time"], option=q),
        bwd_time=check_time("bwd_time", i, values["bwd_time"], option=q),
        fwd_tmp=check_size("fwd_tmp", i, values["fwd_tmp"], option=q),
        bwd_tmp=check_size("bwd_tmp", i, values["bwd_tmp"], least=-out, option=q),
    )

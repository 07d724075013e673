"""Random chain costs for the solver tests (tests only): small random times and
sizes, some forward-phase drops, some rebuilt backwards and forwards without
recording needing less, some tails;
and random options (random_options)."""

from remat.solver.costs import Costs
from remat.solver.option import Option


def random_costs(rng, n, size=20, zero_times=False, tail=None):
    """A chain of n stages with small random times and sizes; in half of them the
    forward phase drops some stage outputs (Costs.fwd_drop). In two of five (with
    ``tail`` None) the last stage is a tail (Costs.tail) of 0 to 10 times a
    stage's bytes, some of it kept through the backward."""
    t = (lambda: rng.choice([0.0, rng.uniform(0, 3)])) if zero_times else (lambda: rng.uniform(0.1, 3))
    if (rng.random() < 0.4 if tail is None else tail) and n >= 2:
        base = random_costs(rng, n - 1, size, zero_times, tail=False)
        out, big = rng.randint(0, size // 4), size * rng.choice([0, 1, 3, 10])
        saved = out + rng.randint(0, big)
        return base.with_tail(t(), t(), out, saved, rng.randint(0, big), rng.randint(-out, big // 2 + 1),
                              kept=rng.randint(0, saved) if rng.random() < 0.5 else 0)
    out = [rng.randint(0, size) for _ in range(n)]
    costs = Costs(
        fwd_time=[t() for _ in range(n)], fwd_nograd_time=[t() for _ in range(n)],
        bwd_time=[t() for _ in range(n)], out_bytes=out,
        saved_bytes=[o + rng.randint(0, size) for o in out],
        fwd_tmp=[rng.randint(0, size // 2) for _ in range(n)],
        # a third of the stages give their output back in the backward (bwd_tmp < 0)
        bwd_tmp=[rng.randint(0, size // 2) - (rng.randint(0, o) if rng.random() < 1 / 3 else 0) for o in out],
        input_bytes=rng.randint(0, size),
    )
    if rng.random() < 0.5:   # B(i) of a rebuilt stage needs less (Costs.bwd_rebuilt_less)
        less = [rng.randint(0, b + o) if rng.random() < 0.5 else 0 for b, o in zip(costs.bwd_tmp, out)]
        costs = Costs(**{**costs.to_dict(), "bwd_rebuilt_less": less})
    if rng.random() < 0.5:   # a forward without recording needs less (Costs.fwd_nograd_less)
        less = [rng.randint(0, f) if rng.random() < 0.6 else 0 for f in costs.fwd_tmp]
        costs = Costs(**{**costs.to_dict(), "fwd_nograd_less": less})
    if rng.random() < 0.25:   # the caller holds a^L through the step (Costs.output_held)
        costs = Costs(**{**costs.to_dict(), "output_held": True, "held_bytes": costs.held_bytes + out[-1]})
    if rng.random() < 0.5:
        return costs
    drop = [o if i < n - 1 and rng.random() < 0.6 else 0 for i, o in enumerate(out)]
    whole = [d if rng.random() < 0.6 else 0 for d in drop]
    return Costs(**{**costs.to_dict(), "fwd_drop": drop, "fwd_drop_whole": whole})


def unheld(costs, budget):
    """``costs`` with nothing held through the step (``held_bytes`` 0) and ``budget``
    less what was: the C solver's problem (``solve`` takes held_bytes off the
    budget before calling it)."""
    return Costs(**{**costs.to_dict(), "held_bytes": 0, "tail_kept": 0}), budget - costs.held_bytes


def random_options(rng, costs, most=3):
    """``costs`` with 0 to ``most`` random options on each stage but a tail
    (Costs.options): most keep less than the stage's record and take longer in
    its backward, as a real option does; some keep more, or are faster, which
    the solvers must weigh all the same."""
    options = []
    for i in range(costs.length):
        listed = []
        for _ in range(0 if costs.tail and i == costs.length - 1 else rng.randint(0, most)):
            out, saved = costs.out_bytes[i], costs.saved_bytes[i]
            odd = rng.random() < 0.2
            listed.append(Option(
                saved_bytes=rng.randint(out, saved + (out + 5 if odd else 0)),
                fwd_time=costs.fwd_time[i] * rng.uniform(0.5 if odd else 0.9, 1.1),
                bwd_time=costs.bwd_time[i] * rng.uniform(0.5 if odd else 1.0, 2.0),
                fwd_tmp=rng.randint(0, costs.fwd_tmp[i] + 2),
                bwd_tmp=rng.randint(-out, max(costs.bwd_tmp[i], 0) + saved - out + 2)))
        options.append(listed)
    return Costs(**{**costs.to_dict(), "options": options})

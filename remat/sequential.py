"""``remat.Sequential``: an ``nn.Sequential`` whose layers run as a remat chain,
for people coming from rotor's ``Checkpointable`` or memonger's
``SublinearSequential`` (docs/how-it-works.md, "The life of a chain").

Note [Stages of a Sequential]
-----------------------------
1. Nested ``nn.Sequential`` containers are flattened, depth first, and each
   leaf layer becomes one stage. The modules stay where they are, so the
   state dict is the one of the ``nn.Sequential`` with the same layers.
2. A stage must not modify its input in place (remat keeps that input to
   recompute the stage). A layer with ``inplace=True`` (``ReLU``,
   ``Dropout``, ``Hardtanh`` ...) therefore joins the stage before it, where
   it modifies that stage's own output, as it does in plain PyTorch. In-place
   layers at the very start run before the chain, on the caller's tensor.
   Layers that may hand on their input itself (``Identity``, a ``Dropout`` in
   eval mode or at p=0: ``_PASSING``) end no stage for an in-place layer
   after them: it joins the stage before them, with them (at the start, all
   run before the chain).
3. A stage is a ``_Group`` of layers marked with ``remat.stage``; the chain
   is keyed by the first group's identity, so the groups are made once and
   kept while the layers (and their ``inplace`` flags) stay the same.
   ``_Group.training`` gives every layer's training flag, so switching any
   layer between train and eval makes a new chain key, measured anew.
4. A group without parameters may save no tensor for backward at all
   (``Flatten``, padding, eval-mode ``Dropout``). The runtime then holds no
   handle of that stage, forgets it after a forward without recording, and
   fails when the schedule recomputes it ("the input of stage k ... is no
   longer held"). Such a group ends with ``_Keep``, an identity that saves a
   constant token and reads it in its backward, so the stage is held and
   recomputed like any other. The last group needs none (the forward phase
   always records the last stage) and gets none, so the caller may modify
   the output in place. Remove once remat/runtime/executor.py keeps stages that save
   nothing.
"""

import collections

import torch
from torch import nn

from .chain import NO_LIMIT, ChainHints, chain, explain, parse_budget, resolve_budget
from .errors import RematError, UsageError
from .measure.linger import LINGERING, settle
from .runtime.replay import capture_rng, cuda_devices
from .solver.solve import DEFAULT_SLOTS, solve as _solve
from .stage import stage

__all__ = ["Sequential"]


# (shown only where the chain ran no stage: a Sequential that is empty, or all in place)
# layers that may return their input itself (Note [Stages of a Sequential] 2)
_PASSING = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_HINTS = ChainHints(empty="this remat.Sequential has no stage: it is empty or all its layers work in place "
                          "(each joins the stage before it)")

class _Keep(torch.autograd.Function):
    """Identity saving a constant token (Note [Stages of a Sequential], 4)."""

    token = torch.zeros(())

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(_Keep.token)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors    # unpacking lets the runtime recompute this stage when its schedule says
        return grad


class _Group:
    """Consecutive layers run as one stage (Note [Stages of a Sequential], 3)."""

    def __init__(self, layers, names, everything):
        self.layers = layers
        self.keep = not any(True for layer in layers for _ in layer.parameters())
        self.everything = everything
        self.__name__ = self.__qualname__ = "+".join(
            f"{name}:{type(layer).__name__}" for name, layer in zip(names, layers))

    @property
    def training(self):
        return tuple(layer.training for layer in self.everything)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        if self.keep and isinstance(x, torch.Tensor) and x.requires_grad:
            x = _Keep.apply(x)
        return x


def _leaves(module, prefix):
    """(name, layer) of every non-Sequential layer under ``module``, in call order."""
    for name, child in module._modules.items():
        if child is None:
            continue
        path = f"{prefix}{name}"
        if isinstance(child, nn.Sequential):
            yield from _leaves(child, path + ".")
        else:
            yield path, child


class Sequential(nn.Sequential):
    """An ``nn.Sequential`` trained under an activation-memory budget.

    Each layer is one stage of a ``remat.chain`` (nested ``nn.Sequential``
    containers are flattened); in-place layers join the stage before them.
    Parameters, buffers and state-dict keys are those of ``nn.Sequential``
    with the same layers, so checkpoints load both ways.

    Args:
        *layers: modules, or one ``OrderedDict`` of named modules, as for
            ``nn.Sequential``.
        budget: activation memory allowed (see ``remat.chain``); None runs
            the layers plainly.
        algorithm: "optimal", "store_all", "min_memory", "sqrt" or
            "periodic(k)".
        slots: memory resolution of the optimal solver.
        costs: path of a JSON file of measured costs (see ``remat.chain``).
        options: plan each layer's option 1 where it pays (see ``remat.chain``).

    The first call with a new input signature measures every layer, then
    calls run the schedule; ``measure`` and ``solve`` do the same steps
    explicitly. Forward hooks of nested ``nn.Sequential`` containers do not
    run under a budget (their layers are called one by one); hooks of the
    layers do, and run again when a layer is recomputed.

    Example:
        >>> import torch, remat
        >>> seq = remat.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(inplace=True),
        ...                        torch.nn.Linear(8, 2), budget="1MiB")
        >>> seq(torch.randn(4, 8)).sum().backward()
        >>> sorted(seq.state_dict()) == sorted(torch.nn.Sequential(*seq).state_dict())
        True
    """

    options = "auto"   # (a Sequential pickled before the setting had none)

    def __init__(self, *layers, budget="auto", algorithm="optimal", slots=DEFAULT_SLOTS, costs=None,
                 options="auto"):
        super().__init__(*layers)
        self.budget = budget
        self.algorithm = algorithm
        self.slots = slots
        self.costs_path = costs
        self.options = options
        self._spec = self._make_spec()
        self._layout = None      # (layer ids and inplace flags, leading layers, stages)
        self._explanation = None
        self._device = None

    @classmethod
    def from_module(cls, module, **kwargs):
        """A ``remat.Sequential`` over the layers of ``module`` (shared, not copied).

        Args:
            module: an ``nn.Sequential``; its layer names are kept.
            **kwargs: ``budget``, ``algorithm``, ``slots``, ``costs``, ``options``.

        Example:
            >>> import torch, remat
            >>> plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Tanh()))
            >>> remat.Sequential.from_module(plain, budget="1MiB")[1][0] is plain[1][0]
            True
        """
        if not isinstance(module, nn.Sequential):
            raise UsageError(f"remat.Sequential.from_module needs an nn.Sequential, got {type(module).__name__}")
        return cls(collections.OrderedDict(module._modules), **kwargs)

    def __getitem__(self, idx):
        out = super().__getitem__(idx)
        if isinstance(idx, slice):
            out.budget, out.algorithm, out.slots, out.options = self.budget, self.algorithm, self.slots, self.options
        return out

    def __add__(self, other):
        return self._like(super().__add__(other))   # (nn.Sequential's makes an nn.Sequential)

    def __mul__(self, other):
        return self._like(super().__mul__(other))

    def _like(self, plain):
        """A ``remat.Sequential`` of ``plain``'s layers with this one's settings (not its costs file:
        its costs are this chain's)."""
        return type(self)(collections.OrderedDict(plain._modules), budget=self.budget, algorithm=self.algorithm,
                          slots=self.slots, options=self.options)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_layout"] = state["_explanation"] = None   # (this process's: what its calls ran)
        return state

    def extra_repr(self):
        return f"budget={self.budget!r}, algorithm={self.algorithm!r}"

    def _make_spec(self):
        if self.budget is None:
            return None
        return chain(budget=self.budget, algorithm=self.algorithm, slots=self.slots, costs=self.costs_path,
                     options=self.options, hints=_HINTS)

    def _stages(self):
        """Leading in-place layers and the stages (Note [Stages of a Sequential])."""
        leaves = list(_leaves(self, ""))
        key = tuple((id(layer), bool(getattr(layer, "inplace", False))) for _, layer in leaves)
        layout = self._layout
        if layout is not None and layout[0] == key:
            return layout[1], layout[2]
        everything = [layer for _, layer in leaves]
        lead, groups = [], []
        for name, layer in leaves:
            inplace = getattr(layer, "inplace", False)
            while inplace and groups and all(isinstance(m, _PASSING) for m in groups[-1][1]):   # (2 of the Note)
                names, layers = groups.pop()
                if not groups:
                    lead.extend(layers)
                    break
                groups[-1][0].extend(names)
                groups[-1][1].extend(layers)
            if inplace and groups:
                groups[-1][0].append(name)
                groups[-1][1].append(layer)
            elif inplace:
                lead.append(layer)
            else:
                groups.append(([name], [layer]))
        made = [_Group(layers, names, everything) for names, layers in groups]
        if made:
            made[-1].keep = False   # the last stage always records (Fall) and its output may be edited in place
        stages = [stage(group) for group in made]
        self._layout = (key, lead, stages)
        return lead, stages

    def forward(self, x):
        if self.budget is None or not torch.is_grad_enabled():
            if LINGERING:   # (a meter left by a measuring call whose backward never came: an evaluation after it)
                settle()
            return super().forward(x)
        spec = self._spec
        if spec is None or spec.settings != (self.budget, self.algorithm, self.slots, self.costs_path, self.options):
            spec = self._spec = self._make_spec()
        return self._run(x, spec)

    def _run(self, x, spec):
        lead, stages = self._stages()
        for layer in lead:
            x = layer(x)
        if isinstance(x, torch.Tensor):
            self._device = x.device
        with spec:    # the one chain site of every Sequential (Note [Chain keys] in remat/chain.py)
            for s in stages:
                x = s(x)
        self._explanation = explain() if stages else None   # (no stage: no chain ran, explain() is another's)
        return x

    def measure(self, sample):
        """Measure every layer on ``sample`` now, instead of in the first call.

        Runs one measuring forward on a detached copy of ``sample`` and leaves
        no trace: parameter ``.grad``, buffers (BatchNorm statistics) and the
        RNG streams are as before. Later calls with inputs like ``sample``
        (same shape, dtype, device and ``requires_grad``, same train/eval
        mode) then run on these costs. The code after the Sequential (its loss)
        is not run here: the first call meters it, running as a measuring call
        on these costs (no layer's backward in its forward), under the budget,
        and the calls after it run the schedule that counts it.

        Args:
            sample: an input like the real ones.

        Returns:
            The measured ``remat.Costs``.

        Example:
            >>> import torch, remat
            >>> seq = remat.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), budget="1MiB")
            >>> seq.measure(torch.randn(4, 8)).stages
            2
        """
        x = sample.detach().requires_grad_(sample.requires_grad) if isinstance(sample, torch.Tensor) else sample
        grads = [(p, p.grad) for p in self.parameters()]
        buffers = [(b, b.detach().clone()) for b in self.buffers()]
        tensors = [x] + [p for p, _ in grads] if isinstance(x, torch.Tensor) else [p for p, _ in grads]
        rng = capture_rng(cuda_devices(tensors))
        probe = chain(budget=NO_LIMIT, algorithm="store_all", slots=self.slots, costs=self.costs_path, hints=_HINTS)
        out = None   # (held to the end: its graph going would have the next call measure again, linger.release)
        try:
            with rng.replayed(), torch.enable_grad():
                out = self._run(x, probe)
        finally:
            settle(cut=True)   # (no backward comes: the meter its measuring call left after its block goes, and
            # its tail, unseen, is metered by the next call: Note [The chain's tail] 6, remat/measure/tail.py)
            with torch.no_grad():
                for b, old in buffers:
                    b.copy_(old)
            for p, g in grads:
                p.grad = g
        del out
        if self._explanation is None:
            raise RematError(
                "remat: this Sequential has no stage to measure: it is empty or all its layers work in "
                "place (each joins the stage before it); give it a layer that computes a new tensor")
        record = self._explanation._record
        if record is not None and record.tail is not None and record.tail.kept is None:
            # the next call runs as a measuring call on these costs: its plan could not count the code after
            # the Sequential, which it meters, and went over the budget by what that needs (14%, a 1,024-class
            # head); so it holds no layer's input while that code runs, as a first call does
            record.remeasure = "given"
        return self._explanation.costs

    def solve(self, budget=None):
        """The schedule for ``budget``, from the costs measured by ``measure`` or
        by the first call; later calls run it. The two calls after the measuring
        one time the stages again (Note [Timing the second call], remat/measure/refine.py):
        from then on the calls run the schedule ``solve`` gives for those times.

        Args:
            budget: activation memory allowed (see ``remat.chain``); None keeps
                ``self.budget``. A new budget becomes ``self.budget``.

        Returns:
            The ``remat.Schedule`` the next calls run.

        Raises:
            RematError: nothing measured yet.
            BudgetError: the budget is below the chain's minimum.

        Example:
            >>> import torch, remat
            >>> seq = remat.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
            >>> _ = seq.measure(torch.randn(4, 8))
            >>> seq.solve("1MiB").stages
            3
        """
        if self._explanation is None:
            raise RematError(
                "remat: this Sequential has measured nothing yet; call seq.measure(sample_input) "
                "or run one forward with grad enabled first")
        if budget is None:
            budget = self.budget
        if budget is None:
            raise RematError("remat: no budget to solve for; pass one, e.g. seq.solve('1GiB')")
        parsed = parse_budget(budget)
        schedule = _solve(self._explanation.costs, resolve_budget(parsed, self._device or "cpu"),
                          self.algorithm, self.slots)
        self.budget = budget
        return schedule

"""``remat.wrap`` / ``remat.unwrap``: run a model you did not write (a Hugging
Face transformer, a timm network) under remat without editing its source
(docs/how-it-works.md, "The life of a chain").

Note [Wrapping a model]
-----------------------
1. Each module of ``blocks`` is marked with ``remat.stage(module)`` (an
   instance ``forward`` attribute); blocks the user had marked already stay
   marked after ``unwrap``, and so do blocks another wrapped model shares
   (two heads on one backbone) until the last of them is unwrapped
   (``_CLAIMS``: unwrapping one left the other a chain of no stages, 2.4x
   over its budget).
2. The model gets an instance ``forward`` attribute, a ``_WrappedForward``
   that opens the model's ``remat.chain`` around the original bound forward.
   The ``with`` is one line of this module for every wrapped model; chains
   are told apart by their first stage (Note [Chain keys] in
   remat/chain.py), so each model keeps its own measurements. It carries the
   original forward's signature, so code that inspects ``model.forward``
   (Hugging Face's ``generate``) sees the same parameters.
3. ``use_cache``: with a key/value cache a block appends its keys and values
   to a cache object (a side input) and, in older versions, returns them,
   with gradient, as extra outputs. A recomputation would append them a
   second time, and extra outputs of a stage may not carry gradient. So
   while grad is enabled a wrapped model whose forward takes ``use_cache``
   (by name, or through ``**kwargs`` where the model has a ``config.use_cache``)
   is called with ``use_cache=False``; passing ``use_cache=True`` then is an
   error, and so is a cache given as ``past_key_values``. A wrapped module
   whose forward does not take it and calls a transformers model (a module
   computing its own loss around one, DDP around one) runs with the
   ``use_cache`` of every such model's config off, put back after. Under
   ``torch.no_grad()`` (generation) stages run plainly and ``use_cache``
   passes through untouched.
4. ``unwrap`` deletes both kinds of instance attribute, putting back an
   instance ``forward`` the model had before ``wrap``: the model is then the
   object it was, with the same state dict.
"""

import inspect
import weakref

import torch

from .chain import ChainHints, chain
from .errors import StageError, UsageError
from .solver.solve import DEFAULT_SLOTS
from .stage import is_stage, stage, unstage

__all__ = ["wrap", "unwrap"]

_CLAIMS = weakref.WeakKeyDictionary()   # block: how many wrapped models marked it or share it (Note 1)


class _WrappedForward:
    """A wrapped model's forward: the original one inside the model's chain (Note [Wrapping a model], 2)."""

    def __init__(self, model, original, spec, blocks, marked, previous):
        # the modules whose gradient_checkpointing flag transformers' gradient_checkpointing_enable()
        # sets: read on every call, not the model's property, which walks every module
        self.flagged = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        self.kind = type(model).__name__
        self.original = original    # the bound forward wrap found
        self.spec = spec
        self.blocks = blocks
        self.marked = marked        # the blocks wrap marked or shares with another wrap (``_CLAIMS``)
        self.previous = previous    # the model's instance forward before wrap, or None
        params = inspect.signature(original).parameters
        self.cache_at = _position(params, "use_cache")   # None, or -1 if keyword-only
        if self.cache_at is None and any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()) \
                and hasattr(getattr(model, "config", None), "use_cache"):
            # (a transformers model whose forward takes use_cache through **kwargs, or a
            # user's forward(**batch) around one: it reaches the model that makes the cache)
            self.cache_at = -1
        self.past_at = _position(params, "past_key_values")
        # transformers models inside it that it does not hand ``use_cache`` (a module whose forward calls
        # one, DDP around one): their configs' off while it runs with grad (went 21-39% over, caches written again)
        self.configs = [] if self.cache_at is not None else list(
            {id(c): c for m in model.modules() if hasattr(c := getattr(m, "config", None), "use_cache")}.values())

    @property
    def __signature__(self):
        return inspect.signature(self.original)

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        if self.flagged and any(m.gradient_checkpointing for m in self.flagged):
            raise _checkpointing_on(self.kind, " since remat.wrap")
        if self.cache_at is not None:
            args, kwargs = self._without_cache(args, kwargs)
        at = self.past_at
        past = args[at] if at is not None and 0 <= at < len(args) else kwargs.get("past_key_values")
        if past is not None:
            raise StageError(
                "remat: a wrapped model was given past_key_values while grad is enabled; its blocks add "
                "this call's keys and values to that cache, and every run of a block (remat measures and "
                "recomputes them) would add them again. Train without a cache, or call remat.unwrap(model) "
                "for the steps that need one; under torch.no_grad() the model runs plainly")
        with self.spec, _caches_off(self.configs):
            return self.original(*args, **kwargs)

    def _without_cache(self, args, kwargs):
        """``use_cache=False``, or an error if the caller asked for a cache (Note [Wrapping a model], 3)."""
        at = self.cache_at
        if 0 <= at < len(args):
            given = args[at]
            args = args[:at] + (False,) + args[at + 1:]
        else:
            given = kwargs.get("use_cache")
            kwargs["use_cache"] = False
        if given:
            raise StageError(
                "remat: a wrapped model was called with use_cache=True while grad is enabled; a "
                "recomputed block would write its key/value cache a second time. Pass "
                "use_cache=False for training (the default under remat.wrap), or generate under "
                "torch.no_grad(), where the model runs plainly"
            )
        return args, kwargs


class _caches_off:
    """``use_cache`` off in ``configs`` for the block, as they were after it (Note [Wrapping a model], 3)."""

    def __init__(self, configs):
        self.configs, self.was = configs, None

    def __enter__(self):
        self.was = [c.use_cache for c in self.configs]
        for c in self.configs:
            c.use_cache = False

    def __exit__(self, *exc):
        for c, was in zip(self.configs, self.was):
            c.use_cache = was
        return False


def _position(params, name):
    """The position of parameter ``name`` among ``params``, -1 if keyword-only, None if absent."""
    param = params.get(name)
    if param is None:
        return None
    if param.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return list(params).index(name)
    return -1 if param.kind == inspect.Parameter.KEYWORD_ONLY else None


def _checkpointing_on(kind, when=""):
    """The StageError for a ``kind`` model with transformers' own gradient
    checkpointing on (turned on ``when``): its recomputations and remat's would both run."""
    return StageError(
        f"remat.wrap: this {kind} has transformers' gradient checkpointing on{when} "
        f"(gradient_checkpointing_enable()); remat recomputes on its own schedule, and both together "
        f"recompute twice and measure the wrong costs. Call model.gradient_checkpointing_disable() first "
        f"(activation_checkpointing_disable() in the transformers releases that renamed it); "
        f"under transformers.Trainer, give TrainingArguments(gradient_checkpointing=False), which is what "
        f"turns it on there")


def _checked_blocks(model, blocks):
    """``blocks`` as a list, once ``model`` and they are fit to wrap (the errors of ``wrap``)."""
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"remat.wrap needs an nn.Module, got {type(model).__name__}")
    if isinstance(model.__dict__.get("forward"), _WrappedForward):
        raise StageError(
            f"remat: this {type(model).__name__} is wrapped already; call remat.unwrap(model) "
            f"before wrapping it again with other blocks or another budget"
        )
    if isinstance(blocks, torch.nn.Module) and not isinstance(blocks, (torch.nn.ModuleList, torch.nn.Sequential)):
        raise UsageError(
            f"remat.wrap needs an iterable of blocks, e.g. model.layers, got one {type(blocks).__name__}; "
            f"pass [block] for a single one"
        )
    # (transformers 5 names it is_activation_checkpointing; its old name warns there)
    flag = ("is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing")
            else "is_gradient_checkpointing")
    if getattr(model, flag, False) is True:
        raise _checkpointing_on(type(model).__name__)
    try:
        blocks = list(blocks)
    except TypeError:
        raise UsageError(f"remat.wrap needs an iterable of blocks, e.g. model.layers, got "
                        f"{type(blocks).__name__}") from None
    if not blocks:
        raise UsageError("remat.wrap: blocks is empty; pass the modules that form the chain, e.g. model.transformer.h")
    inside = {id(m) for m in model.modules()}
    for i, block in enumerate(blocks):
        if not isinstance(block, torch.nn.Module):
            raise UsageError(f"remat.wrap: block {i} is a {type(block).__name__}, not an nn.Module")
        if id(block) not in inside:
            raise UsageError(
                f"remat.wrap: block {i} ({type(block).__name__}) is not a submodule of this "
                f"{type(model).__name__}; its calls would not be part of the model's chain"
            )
        if block is model:
            raise UsageError("remat.wrap: the model cannot be one of its own blocks")
        if isinstance(block, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            raise UsageError(
                f"remat.wrap: block {i} is a {type(block).__name__}, a container that is never called; "
                f"pass its blocks themselves (remat.wrap(model, model.layers), not [model.layers])")
        fwd = block.__dict__.get("forward")
        if fwd is not None and not is_stage(block):
            raise StageError(
                f"remat.wrap: block {i} ({type(block).__name__}) already has its own forward "
                f"attribute (set by another library's hooks, e.g. accelerate); remat.stage would "
                f"replace it. Remove those hooks, or mark the block's class forward with remat.stage"
            )
    return blocks


def _layers_hint(model, blocks):
    """Where ``blocks`` are parts of distinct layers of one list of ``model`` (the attention
    module of each layer), the hint to pass the layers: the code of each layer between two
    parts changes the activation."""
    parent = {id(child): (name, module) for name, module in model.named_modules()
              for child in module.children()}
    layers = []
    for block in blocks:
        node = block
        while id(node) in parent and not isinstance(parent[id(node)][1], (torch.nn.ModuleList, torch.nn.Sequential)):
            node = parent[id(node)][1]
        if node is block or id(node) not in parent:
            return None
        layers.append((parent[id(node)][0], node))
    if len({name for name, _ in layers}) != 1 or len({id(layer) for _, layer in layers}) != len(layers):
        return None
    where = f"model.{layers[0][0]}" if layers[0][0] else "the model"
    return (f". With remat.wrap: the blocks given are parts of the layers of {where} ({type(blocks[0]).__name__} "
            f"inside {type(layers[0][1]).__name__}), and each layer's own code runs between them; pass the layers "
            f"themselves: remat.wrap(model, {where})")


def wrap(model, blocks, budget="auto", algorithm="optimal", slots=DEFAULT_SLOTS, costs=None, *, options="auto"):
    """Run ``model`` under remat: each module of ``blocks`` is a stage and the
    model's forward runs inside a ``remat.chain``. Nothing is copied; the
    parameters, buffers and state dict stay the model's own.

    Args:
        model: an ``nn.Module`` whose forward calls the blocks one after the
            other, each on the previous one's output, with no code changing
            that output in between (code before the first block and after the
            last is free).
        blocks: the modules that form the chain, e.g. ``model.transformer.h``;
            each must be a submodule of ``model``. A block's first tensor
            argument is the activation; masks, position ids, rotary tables and
            flags are side inputs and pass through.
        budget, algorithm, slots, costs, options: as for ``remat.chain``.

    Returns:
        ``model``, wrapped in place; ``remat.unwrap(model)`` undoes it.

    Raises:
        RematError: ``model`` is wrapped already (unwrap it first).
        ValueError: ``blocks`` is empty or holds a module outside ``model``.
        TypeError: ``model`` or a block is not an ``nn.Module``.

    While grad is enabled, a model whose forward takes ``use_cache`` runs
    with ``use_cache=False`` (a recomputation would write the key/value cache
    twice; see Note [Wrapping a model], 3). Under ``torch.no_grad()`` the
    model runs exactly as before. Dropout and BatchNorm behave as in plain
    PyTorch: recomputations replay RNG and do not update running statistics.
    Forward hooks on modules *inside* a block run again whenever the block
    is recomputed, and several times in the first call of a new input shape,
    which measures each block by running it more than once: Hugging Face's
    ``output_attentions=True`` then returns extra attention maps from that
    call (``output_hidden_states`` is collected by hooks on the blocks
    themselves and is right). With transformers 4, whose blocks return their
    attention maps, ``output_attentions=True`` while grad is enabled raises
    ``StageError`` (only a stage's first output may need grad).

    Example:
        >>> import torch, remat
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        ...     def forward(self, x):
        ...         for b in self.blocks:
        ...             x = b(x)
        ...         return x.sum()
        >>> net = Net()
        >>> _ = remat.wrap(net, net.blocks, budget="1MiB")
        >>> net(torch.randn(2, 8)).backward()
        >>> remat.unwrap(net) is net
        True
    """
    blocks = _checked_blocks(model, blocks)
    hints = ChainHints(
        empty=(f"remat.wrap: the forward of this {type(model).__name__} called none of the "
               f"{len(blocks)} blocks given; pass the blocks it calls, e.g. model.transformer.h"),
        split=_layers_hint(model, blocks) or (
            ". With remat.wrap: blocks that do not hand their output straight to the next (an "
            "encoder's layers and a decoder's) are two chains; wrap each part apart, e.g. "
            "remat.wrap(model.encoder, encoder layers) and remat.wrap(model.decoder, decoder layers)"),
        nested=("remat.wrap opens a chain in the forward of each model it wraps, so a wrapped model "
                "cannot run inside another: wrap the inner models side by side instead (an "
                "encoder-decoder: remat.wrap(model.encoder, encoder layers) and "
                "remat.wrap(model.decoder, decoder layers)), each a chain of its own"))
    spec = chain(budget=budget, algorithm=algorithm, slots=slots, costs=costs, options=options, hints=hints)
    marked, seen = [], set()
    for block in blocks:
        if id(block) in seen:
            continue
        seen.add(id(block))
        if block in _CLAIMS or not is_stage(block):   # (not one the user marked)
            stage(block)
            _CLAIMS[block] = _CLAIMS.get(block, 0) + 1
            marked.append(block)
    previous = model.__dict__.get("forward")
    model.forward = _WrappedForward(model, model.forward, spec, blocks, marked, previous)
    return model


def unwrap(model):
    """Undo ``remat.wrap(model, ...)``: the model and its blocks are as before.

    Args:
        model: a model ``remat.wrap`` returned.

    Returns:
        ``model``.

    Raises:
        ValueError: ``model`` is not wrapped.

    Example:
        >>> import torch, remat
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> remat.unwrap(remat.wrap(net, [net[0]], budget="1MiB")) is net
        True
        >>> "forward" in vars(net)
        False
    """
    wrapped = model.__dict__.get("forward") if isinstance(model, torch.nn.Module) else None
    if not isinstance(wrapped, _WrappedForward):
        raise UsageError(f"remat.unwrap: this {type(model).__name__} is not wrapped by remat.wrap")
    for block in wrapped.marked:
        left = _CLAIMS.pop(block, 1) - 1   # (a model unpickled: its blocks its own)
        if left:
            _CLAIMS[block] = left
        else:
            unstage(block)
    if wrapped.previous is None:
        del model.__dict__["forward"]
    else:
        model.__dict__["forward"] = wrapped.previous
    return model

"""``Costs``: what one chain costs, stage by stage (docs/how-it-works.md, "The cost model").

Stage i (1..L) is at index i-1 of every list. Times are seconds, sizes bytes.
"""

import json
import numbers
import os
from dataclasses import MISSING, dataclass, fields

from ..errors import CostsError
from ..units import format_bytes
from .checks import (MAX_BYTES, MAX_SECONDS, check_size, check_time, entries, file_path,  # noqa: F401  (MAX_*: as before)
                     check_numbers, check_uniform, drops_field, least_bytes, less_field, stage_options)
from .option import check_options

__all__ = ["Costs"]

# The "format" a costs file is written with: FORMAT, or FORMAT_OPTIONS where a
# stage has options (older remat, which cannot plan them, refuses such a file by
# its format); read: either, or none.
FORMAT = "remat.costs/1"
FORMAT_OPTIONS = "remat.costs/2"
MAX_FILE_BYTES = 64 * 2**20   # the largest costs file read (about 70 bytes a stage: some 900,000 stages)

TIME_FIELDS = ("fwd_time", "fwd_nograd_time", "bwd_time")
SIZE_FIELDS = ("out_bytes", "saved_bytes", "fwd_tmp", "bwd_tmp")


@dataclass(frozen=True)
class Costs:
    """Measured costs of a chain of L stages, validated on creation.

    Args:
        fwd_time: forward time of each stage with autograd recording.
        fwd_nograd_time: forward time without recording (recomputations).
        bwd_time: backward time of each stage.
        out_bytes: size of each stage's output a^i (and of its gradient).
        saved_bytes: size of a-bar^i: a^i plus what autograd saves for the
            stage's backward, without parameters, buffers or the stage input.
        fwd_tmp: transient bytes above input and output during the forward.
        bwd_tmp: transient bytes above what B(i) holds during the backward;
            down to ``-out_bytes[i]`` where B(i) does not read a^i, which
            a-bar^i counts but which is gone by then.
        input_bytes: size of a^0, the chain input (and of its gradient).
        bwd_rebuilt_less: bytes B(i)'s transient is below ``bwd_tmp`` where
            a-bar^i was rebuilt in the backward phase rather than recorded in
            the forward phase: remat lets a rebuilt stage's saved tensors go as
            the engine unpacks them, so they are gone as a node's apply returns,
            while autograd keeps what it saved itself until the node's outputs
            are checked (a bias's gradient summed to its shape). None (the
            default): 0 everywhere; at most ``bwd_tmp[i] + out_bytes[i]``.
        fwd_nograd_less: bytes the forward's transient is below ``fwd_tmp``
            where it runs without recording (``Fn``, ``Fck`` after ``Loss``):
            the tensors the recording forward saves are let go as soon as the
            ops that read them are done. None (the default): 0 everywhere; at
            most ``fwd_tmp[i]``.
        fwd_drop: bytes of a^i let go in the forward phase once stage i+1 has
            run recording (``Fall``), where a^i is held on its own (after
            ``Fn``/``Fck`` of stage i): stage i+1's recording does not keep its
            input, nor does the code around the chain. 0 (the default): kept
            until B(i+1). At most ``out_bytes[i]``; 0 for the last stage.
        fwd_drop_whole: the same where a^i is inside a-bar^i (after ``Fall(i)``):
            also needs B(i) not to read a^i. Either 0 or ``fwd_drop[i]``.
        held_bytes: bytes the chain holds through the whole step beside its
            activations (default 0): gradients the engine holds across stages
            (of a leaf used by two stages, that of the later use waits for the
            earlier's, to be summed), tensors stages keep outside autograd's
            saved tensors, activations the code around the chain keeps.
        tail: the last stage is the chain's tail, not one of its stages: the
            code that runs after the chain's last stage until the backward
            reaches it (the model's head and the loss, rotor's loss stage),
            which runs once, as the caller runs it: recorded (``Fall``) in the
            forward phase and backwarded right after ``Loss``, never
            recomputed (its ``fwd_nograd_time`` is not used). Its
            ``saved_bytes`` is what it holds when its backward starts, and
            ``held_bytes`` counts what the caller keeps of it through the rest
            of the backward (``with_tail``).
        tail_kept: of ``held_bytes``, the bytes of the tail's the caller keeps
            (0 without a tail).
        output_held: ``held_bytes`` counts a^L, the output of the chain's last
            stage (before its tail, if any), which the code around the chain
            holds through the step (remat/measure/chain_record.py Note [The
            chain's output]): a^L held on its own, or made by ``Fall(L)``, takes
            nothing more (``alone_sizes``), but where made again after Loss.
        options: for each stage, a list of ``Option``: other ways to record it
            that keep less than a-bar^i and rebuild the rest in B(i)
            (remat/solver/option.py Note [Options]); ``Fall(i, option=k)`` runs
            the k-th (1-based; option 0 is the base record, these fields).
            None (the default): no options anywhere; the tail has none.
        cast_bytes: of ``held_bytes``, each stage's share that autocast's cache
            holds (the bf16 copies of its weights and biases) from the stage's
            first forward until the autocast block ends, before the backward;
            after ``Loss`` only its records (Note [Accounting] 10). None (the
            default): 0 everywhere, all of ``held_bytes`` through the step.

    Raises:
        CostsError: a list has the wrong length, a size is not a
            non-negative int (a bwd_tmp one of at least ``-out_bytes``),
            a time is not finite and non-negative, or an option is not an
            ``Option`` (or a dict of its fields) with such numbers.

    Example:
        >>> c = Costs.uniform(3, time=1.0, size=100)
        >>> c.length
        3
    """

    fwd_time: tuple
    fwd_nograd_time: tuple
    bwd_time: tuple
    out_bytes: tuple
    saved_bytes: tuple
    fwd_tmp: tuple
    bwd_tmp: tuple
    input_bytes: int
    fwd_drop: tuple = None
    fwd_drop_whole: tuple = None
    held_bytes: int = 0
    bwd_rebuilt_less: tuple = None
    fwd_nograd_less: tuple = None
    tail: bool = False
    tail_kept: int = 0
    output_held: bool = False
    options: tuple = None
    cast_bytes: tuple = None

    def __post_init__(self):
        length = None
        for name in TIME_FIELDS + SIZE_FIELDS:
            values = entries(name, getattr(self, name), length)
            length = len(values)
            if name in TIME_FIELDS:
                checked = tuple(check_time(name, i, v) for i, v in enumerate(values))
            else:
                leasts = least_bytes(name, self.out_bytes)
                checked = tuple(check_size(name, i, v, 0 if leasts is None else leasts[i])
                                for i, v in enumerate(values))
            object.__setattr__(self, name, checked)
        object.__setattr__(self, "input_bytes", check_size("input_bytes", None, self.input_bytes))
        object.__setattr__(self, "held_bytes", check_size("held_bytes", None, self.held_bytes))
        for name, field, more in (("bwd_rebuilt_less", "bwd_tmp", self.out_bytes),
                                  ("fwd_nograd_less", "fwd_tmp", None)):
            object.__setattr__(self, name, less_field(name, getattr(self, name), length, getattr(self, field), more))
        object.__setattr__(self, "fwd_drop", drops_field("fwd_drop", self.fwd_drop, length, self.out_bytes))
        object.__setattr__(self, "fwd_drop_whole",
                           drops_field("fwd_drop_whole", self.fwd_drop_whole, length, self.fwd_drop))
        if not isinstance(self.tail, bool):
            raise CostsError(f"remat: Costs.tail must be True or False, got {self.tail!r}")
        if self.tail and length < 2:
            raise CostsError("remat: Costs.tail is True but there is no stage before the tail; "
                             "a chain with a tail has at least two entries per list (its stages, then the tail)")
        kept = check_size("tail_kept", None, self.tail_kept)
        if kept > self.held_bytes or (kept and not self.tail):
            raise CostsError(f"remat: Costs.tail_kept is {kept}; it is part of held_bytes ({self.held_bytes}), "
                             f"and 0 without a tail")
        object.__setattr__(self, "tail_kept", kept)
        if not isinstance(self.output_held, bool) or (self.output_held and not self.stages):
            raise CostsError(f"remat: Costs.output_held must be True or False (False without stages), "
                             f"got {self.output_held!r}")
        object.__setattr__(self, "options", check_options(self.options, self.out_bytes, self.tail))
        casts = (0,) * length if self.cast_bytes is None else \
            tuple(check_size("cast_bytes", i, v) for i, v in enumerate(entries("cast_bytes", self.cast_bytes, length)))
        if sum(casts) > self.held_bytes - kept or (self.tail and casts[-1]):
            raise CostsError(f"remat: Costs.cast_bytes add up to {sum(casts)}; they are part of held_bytes "
                             f"({self.held_bytes}) less tail_kept ({kept}), and 0 for the tail")
        object.__setattr__(self, "cast_bytes", casts)

    @property
    def bwd_tmp_rebuilt(self):
        """bwd_tmp of B(i) where a-bar^i was rebuilt in the backward phase."""
        return tuple(b - v for b, v in zip(self.bwd_tmp, self.bwd_rebuilt_less))

    @property
    def fwd_tmp_nograd(self):
        """fwd_tmp of a forward without recording (``Fn``, ``Fck`` after ``Loss``)."""
        return tuple(f - v for f, v in zip(self.fwd_tmp, self.fwd_nograd_less))

    @property
    def length(self):
        """Number of stages L, the tail included (the solver's chain)."""
        return len(self.fwd_time)

    @property
    def stages(self):
        """Number of the chain's own stages: ``length`` less the tail."""
        return len(self.fwd_time) - self.tail

    def with_tail(self, fwd_time, bwd_time, out_bytes, saved_bytes, fwd_tmp, bwd_tmp, kept=0):
        """These costs with the chain's tail appended as the last stage (``tail``):
        the code after the chain's last stage, which runs once (docs/how-it-works.md,
        "The tail"). Sizes as a stage's: ``saved_bytes`` what the tail holds as its
        backward starts (its own output, the loss, included), ``fwd_tmp`` its
        forward's peak above its output, ``bwd_tmp`` its backward's above what it
        starts from and the gradient it makes (down to ``-out_bytes``); ``kept``
        the bytes of it the caller holds through the rest of the backward (logits
        a training loop keeps), added to ``held_bytes``."""
        if self.tail:
            raise CostsError("remat: these costs have a tail already")
        check_numbers("with_tail", "an int of bytes", out_bytes=out_bytes, saved_bytes=saved_bytes, kept=kept)
        data = self.to_dict()
        for name, value in (("fwd_time", fwd_time), ("fwd_nograd_time", fwd_time), ("bwd_time", bwd_time),
                            ("out_bytes", out_bytes), ("saved_bytes", max(saved_bytes, out_bytes)),
                            ("fwd_tmp", fwd_tmp), ("bwd_tmp", bwd_tmp), ("fwd_drop", 0), ("fwd_drop_whole", 0),
                            ("bwd_rebuilt_less", 0), ("fwd_nograd_less", 0), ("cast_bytes", 0)):
            if name in data:
                data[name] = [*data[name], value]
        if "options" in data:
            data["options"] = [*data["options"], []]   # (the tail has none: Note [Options] 4)
        data["held_bytes"] += kept
        data["tail"] = True
        data["tail_kept"] = kept
        return Costs.from_dict(data)

    def without_tail(self):
        """The chain's own costs: these less the tail (and what it keeps), or
        these if they have none."""
        if not self.tail:
            return self
        return self._tail_parts()[0]

    def tail_costs(self):
        """The tail as a dict (``with_tail``'s arguments), or None without one."""
        return self._tail_parts()[1] if self.tail else None

    def _tail_parts(self):
        data = self.to_dict()
        tail = {name: data[name].pop() for name in ("fwd_time", "bwd_time", "out_bytes", "saved_bytes",
                                                       "fwd_tmp", "bwd_tmp")}
        for name in ("fwd_nograd_time", "fwd_drop", "fwd_drop_whole", "bwd_rebuilt_less", "fwd_nograd_less",
                     "options", "cast_bytes"):
            if name in data:
                data[name].pop()
        tail["kept"] = self.tail_kept
        data["held_bytes"] -= tail["kept"]
        data["tail"] = False
        data["tail_kept"] = 0
        return Costs.from_dict(data), tail

    def with_held(self, extra):
        """These costs with ``extra`` bytes more held through the step (``held_bytes``)."""
        check_numbers("with_held", "an int of bytes", extra=extra)
        return self if not extra else Costs.from_dict({**self.to_dict(), "held_bytes": self.held_bytes + extra})

    @property
    def has_options(self):
        """Some stage has options (``Costs.options``)."""
        return any(self.options)

    def with_options(self, options):
        """These costs with ``options[k]``, a list of ``Option``, as the options of
        stage k (1-based, as in ``Fall(k, option=...)``) in place of its own; the
        other stages keep theirs."""
        listed = list(self.options)
        for k, given in stage_options(options).items():
            if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= self.length:
                raise CostsError(f"remat: with_options takes stage numbers 1..{self.length}, got {k!r}")
            listed[k - 1] = given
        return Costs.from_dict({**self.to_dict(), "options": listed})

    def without_options(self):
        """These costs with no options anywhere (each stage's base record), or these
        if they have none."""
        if not self.has_options:
            return self
        data = self.to_dict()
        del data["options"]
        return Costs.from_dict(data)

    def sizes(self):
        """Return x[0..L]: the input size followed by each stage's output size."""
        return (self.input_bytes,) + self.out_bytes

    def alone_sizes(self):
        """x[0..L] as each a^j held on its own takes it: ``sizes`` but 0 for the output
        the caller holds, counted in ``held_bytes`` (``output_held``). The gradient of
        a^j still takes x[j]."""
        x = self.sizes()
        if not self.output_held:
            return x
        return x[:self.stages] + (0,) + x[self.stages + 1:]

    @classmethod
    def uniform(cls, length, time=1.0, size=1, saved=None, nograd_time=None):
        """A chain of ``length`` identical stages (handy in examples and tests)."""
        check_uniform(length, time, nograd_time)
        saved = size if saved is None else saved
        nograd_time = time if nograd_time is None else nograd_time
        return cls(
            fwd_time=[time] * length, fwd_nograd_time=[nograd_time] * length,
            bwd_time=[2 * time] * length, out_bytes=[size] * length,
            saved_bytes=[saved] * length, fwd_tmp=[0] * length, bwd_tmp=[0] * length,
            input_bytes=size,
        )

    def to_dict(self):
        """A JSON-ready dict of every field; ``options`` (each a dict of its fields)
        only where some stage has them, ``bwd_rebuilt_less``, ``fwd_nograd_less`` and
        ``cast_bytes`` only where not 0 everywhere and ``output_held`` only where True, so that
        such costs read as before."""
        data = {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in fields(self) if f.name != "options"}
        for name in ("bwd_rebuilt_less", "fwd_nograd_less", "cast_bytes"):
            if not any(getattr(self, name)):
                del data[name]
        if not self.output_held:
            del data["output_held"]
        if self.has_options:
            data["options"] = [[o.to_dict() for o in stage] for stage in self.options]
        return data

    @classmethod
    def from_dict(cls, data):
        """Build from ``to_dict``'s output; raises ``CostsError`` on missing or extra keys."""
        if not isinstance(data, dict):
            raise CostsError(f"remat: costs must be a JSON object, got {type(data).__name__}")
        form = data.get("format", FORMAT)
        if form not in (FORMAT, FORMAT_OPTIONS):
            raise CostsError(
                f"remat: the costs record is in format {form!r}, and this remat reads {FORMAT!r} (or "
                f"{FORMAT_OPTIONS!r}, with options; written by another version of remat?); delete the file "
                f"to measure again")
        names = {f.name for f in fields(cls)}
        optional = {f.name for f in fields(cls) if f.default is not MISSING}   # absent from older files
        missing, extra = names - optional - set(data), set(data) - names - {"format"}
        if missing or extra:
            raise CostsError(
                f"remat: costs record has missing fields {sorted(missing)} and unknown fields "
                f"{sorted(extra)}; it was not written by Costs.save"
            )
        return cls(**{k: data[k] for k in names if k in data})

    def save(self, path):
        """Write the costs to ``path`` as JSON, whole: a regular file through one beside it
        renamed over it, so that a process reading it meanwhile (another job's first
        call) finds the old record or the new one, never the start of one."""
        file_path(path)
        text = json.dumps({"format": FORMAT_OPTIONS if self.has_options else FORMAT, **self.to_dict()}, indent=1)
        where = f"{path}.{os.getpid()}.tmp" if not os.path.exists(path) or os.path.isfile(path) else path
        try:
            with open(where, "w") as fh:
                fh.write(text)
            if where != path:
                os.replace(where, path)
        except OSError as exc:   # (the temporary file's name in the message would mislead)
            raise CostsError(f"remat: cannot write the costs to {path}: {exc.strerror or exc}; give the path of a "
                             f"file in a folder that exists and that this process may write to") from exc
        finally:
            if where != path and os.path.exists(where):
                os.unlink(where)

    @classmethod
    def load(cls, path):
        """Read costs written by ``save``; raises ``CostsError`` if the file is not such a record."""
        file_path(path)
        try:
            with open(path, "rb") as fh:
                raw = fh.read(MAX_FILE_BYTES + 1)   # (a device such as /dev/zero never ends)
            if len(raw) > MAX_FILE_BYTES:
                raise CostsError(
                    f"remat: {path} is over {format_bytes(MAX_FILE_BYTES)}, more than the costs of any chain "
                    f"take; give the path of a costs file written by remat (Costs.save)")
            data = json.loads(raw.decode("utf-8"))   # (as save writes it; json.loads would guess)
        except (ValueError, RecursionError) as exc:   # (JSONDecodeError, UnicodeDecodeError; a file nested too deep)
            raise CostsError(f"remat: {path} is not valid JSON ({exc}); delete it to measure again") from None
        except OSError as exc:
            raise CostsError(f"remat: cannot read costs from {path}: {exc}; give the path of a JSON file") from None
        try:
            return cls.from_dict(data)
        except CostsError as exc:   # (the record's own checks: said with the file it came from)
            why = str(exc).removeprefix("remat: ")
            if "delete the file" not in why:
                why += "; delete the file to measure again, or correct that value"
            raise CostsError(f"remat: costs file {path}: {why}") from None

    def table(self):
        """A per-stage table a person can read."""
        rows = [f"{'stage':>5} {'fwd ms':>9} {'nograd ms':>9} {'bwd ms':>9} {'out':>11} {'saved':>11} {'fwd tmp':>11} "
                f"{'bwd tmp':>11} {'nograd tmp':>11}"]
        rows.append(f"{'input':>5} {'':>9} {'':>9} {'':>9} {format_bytes(self.input_bytes):>11}")
        if self.held_bytes:
            rows.append(f"{'held':>5} {'':>9} {'':>9} {'':>9} {format_bytes(self.held_bytes):>11}")
        if self.tail_kept:
            rows.append(f"{'kept':>5} {'':>9} {'':>9} {'':>9} {format_bytes(self.tail_kept):>11}"
                        f"  (of held: the tail's, kept through the backward)")
        for i in range(self.length):
            tail = self.tail and i == self.length - 1   # (never run without recording)
            rows.append(
                f"{'tail' if tail else i + 1:>5} {self.fwd_time[i] * 1e3:9.3f} {self.fwd_nograd_time[i] * 1e3:9.3f} "
                f"{self.bwd_time[i] * 1e3:9.3f} {format_bytes(self.out_bytes[i]):>11} "
                f"{format_bytes(self.saved_bytes[i]):>11} {format_bytes(self.fwd_tmp[i]):>11} "
                f"{format_bytes(self.bwd_tmp[i]):>11} {'' if tail else format_bytes(self.fwd_tmp_nograd[i]):>11}"
            )
            for q, o in enumerate(self.options[i], 1):
                rows.append(
                    f"{f'o{q}':>5} {o.fwd_time * 1e3:9.3f} {'':>9} {o.bwd_time * 1e3:9.3f} {'':>11} "
                    f"{format_bytes(o.saved_bytes):>11} {format_bytes(o.fwd_tmp):>11} {format_bytes(o.bwd_tmp):>11} "
                    f"{'':>11}")
        return "\n".join(rows)

"""The contract view: what a stage's `run` gets instead of the start-up context.

The view lets the stage read only the slots it needs (and those it has already written itself) plus the
context's INPUTS, and write only the slots it provides; anything else raises StageContractError naming the stage,
the slot and its declarations. Methods of the context are bound to the view, so they read under the same rules.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

from .protocol import StageContractError, StartupContext, names_text


class ContextView:
    """What a stage's `run` gets instead of the context: the context's attributes, under the stage's contract.

    Reading a slot needs it in `needs` (or that this stage wrote it already: its own output); writing one needs it
    in `provides`; the context's INPUTS are readable by all and writable by none. Methods and properties of the
    context run bound to the view, so what they read is checked too. Every violation raises StageContractError and
    is also kept, so the runner fails the stage even when its code caught the error. `reads` (slots read from
    earlier stages) and `writes` are recorded for the StageResult. After the stage the view is closed: it lets go
    of the context, and a reference that outlived the stage fails loudly instead of keeping the context alive.
    """

    __slots__ = ("_ctx", "_stage", "_needs", "_provides", "_slots", "_inputs", "_reads", "_writes", "_violations")

    def __init__(self, ctx: StartupContext, stage: str, needs: tuple[str, ...], provides: tuple[str, ...]) -> None:
        init = object.__setattr__  # this class's own __setattr__ is the context's write path
        init(self, "_ctx", ctx)
        init(self, "_stage", stage)
        init(self, "_needs", needs)
        init(self, "_provides", provides)
        init(self, "_slots", type(ctx).slot_names())
        init(self, "_inputs", type(ctx).INPUTS)
        init(self, "_reads", set())
        init(self, "_writes", set())
        init(self, "_violations", [])

    def _context(self, name: str) -> StartupContext:
        if self._ctx is None:
            raise StageContractError(
                f"stage {self._stage!r}'s view of the start-up context was used for {name!r} "
                f"after the stage ended; keep the values, not the context"
            )
        return cast(StartupContext, self._ctx)

    def _violate(self, message: str) -> StageContractError:
        self._violations.append(message)
        return StageContractError(message)

    def __getattr__(self, name: str) -> Any:
        ctx = self._context(name)
        if name in self._slots:
            if name not in self._writes:
                if name not in self._needs:
                    raise self._violate(
                        f"stage {self._stage!r} read {name!r}, which it does not declare in needs "
                        f"(needs: {names_text(self._needs)})"
                    )
                self._reads.add(name)
            return getattr(ctx, name)
        if name in self._inputs:
            return getattr(ctx, name)
        try:
            attr = inspect.getattr_static(type(ctx), name)
        except AttributeError:
            raise AttributeError(f"{type(ctx).__name__} has no attribute {name!r}") from None
        # Bound to the view, not the context: a method reads slots under the stage's contract (no back door).
        bind = getattr(type(attr), "__get__", None)
        return bind(attr, self, type(ctx)) if bind is not None else attr

    def __setattr__(self, name: str, value: Any) -> None:
        ctx = self._context(name)
        if name in self._inputs:
            raise self._violate(f"stage {self._stage!r} wrote {name!r}, an input of the start-up: inputs are read-only")
        if name not in self._slots:
            raise self._violate(
                f"stage {self._stage!r} wrote {name!r}, which is not a slot of "
                f"{type(ctx).__name__} (slots: {names_text(self._slots)})"
            )
        if name not in self._provides:
            raise self._violate(
                f"stage {self._stage!r} wrote {name!r}, which it does not declare in provides "
                f"(provides: {names_text(self._provides)})"
            )
        self._writes.add(name)
        setattr(ctx, name, value)

    def __delattr__(self, name: str) -> None:
        raise self._violate(f"stage {self._stage!r} deleted {name!r}: slots are written, never deleted")

    def _close(self) -> None:
        object.__setattr__(self, "_ctx", None)

    def __repr__(self) -> str:
        return f"<ContextView of stage {self._stage!r}>"

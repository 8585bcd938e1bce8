"""The error of a setting that cannot take a value: it names the setting by structure.

:class:`SettingError` carries the setting's ``key`` as the raising layer knows it (an optimizer
argument or group key such as ``ns_steps``, or an option of the schema such as ``matrix_lr``)
and, once a front end has said how its users spell that key, the spelling (``where``:
``optimizer.muon.ns_steps``, TorchTune's ``optimizer.ns_steps``). A front end maps keys to its
own spelling by table (:meth:`SettingError.spelled`), never by reading the message. It is a
``ValueError``, so code that catches those keeps working.
"""

from __future__ import annotations

__all__ = ["KINDS", "SettingError"]


KINDS = ("core", "option", "job")
"""Where a setting's key comes from: an argument or group key of the optimizer (``core``), an
option of the ``[optimizer.muon]`` schema (``option``), a field of the front end's own
optimizer section such as ``lr`` or ``beta1`` (``job``)."""


class SettingError(ValueError):
    """``key``: the setting; ``problem``: what is wrong with its value; ``where``: how the user
    spells the setting (empty: the optimizer's own message, which names its argument);
    ``kind``: one of :data:`KINDS`."""

    def __init__(self, key: str, problem: str, where: str = "", kind: str = "core") -> None:
        if kind not in KINDS:
            raise ValueError(f"kind: invalid value {kind!r}; expected one of {KINDS}")
        self.key, self.problem, self.where, self.kind = key, problem, where, kind
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"{self.where}: {self.problem}" if self.where else self.problem

    def __reduce__(self) -> tuple:
        return (SettingError, (self.key, self.problem, self.where, self.kind))

    def spelled(self, where: str) -> SettingError:
        """The same problem, with the setting spelled ``where``."""
        return SettingError(self.key, self.problem, where, self.kind)

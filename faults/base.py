"""One shape for every injected fault, like a Toxiproxy toxic: a handle that proves and heals.

Every injector returns a :class:`Fault` (the in-engine agent an ``ArmedFault``, the network proxy
a ``NetFault``, process faults a ``ProcessFault``):

- ``id``        unique name of this fault (the ``fault`` field of its ``fault`` events)
- ``kind``      what it does: ``delay``, ``hold``, ``latency``, ``limit_data``, ``sigkill``, ``sigstop`` ...
- ``injector``  who made it: ``agent`` | ``proxy`` | ``process``
- ``verify()``  the evidence that it acted; raises :class:`FaultDidNotFire` when there is none, so a
                test that "passed" under a fault that never fired fails instead
- ``heal()``    undo it; idempotent (a second call, or one after the injector's ``heal_all``, does
                nothing); ``healed`` says whether it has been
- ``fired_events()``  the evidence records seen so far (``[]`` when none; never raises)

A handle is also a context manager that heals on exit: ``with proc.stop("decode"): ...``.
"""

from __future__ import annotations

import abc


class FaultDidNotFire(AssertionError):
    """A fault was armed but no injector reported acting: the test proved nothing."""


class Fault(abc.ABC):
    id: str
    kind: str
    injector: str = ""
    healed: bool = False

    @abc.abstractmethod
    def verify(self):
        """Evidence that this fault acted; :class:`FaultDidNotFire` if there is none."""

    @abc.abstractmethod
    def heal(self) -> None:
        """Undo the fault. Idempotent."""

    @abc.abstractmethod
    def fired_events(self) -> list[dict]:
        """The evidence records so far (``[]`` when the fault has not acted)."""

    def evidence(self) -> list[dict]:
        return self.fired_events()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.heal()

"""The result of one doctor check."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass
class CheckResult:
    """What one check found.

    Attributes:
        name: short name of what was checked (``"gpus"``, ``"env NCCL_DEBUG"``, ...).
        status: ``"ok"``, ``"warn"`` (training works, but not as well or not as set up)
            or ``"fail"`` (blocks training, or a setting the user made is not in effect).
        message: what was found, in a sentence or two.
        fix: what to do about it (empty when nothing is to be done).
        details: machine-readable facts for ``--json`` (versions, sizes, pairs, ...).

    Example:
        >>> CheckResult("ports", OK, "can bind a free TCP port").to_dict()["status"]
        'ok'
    """

    name: str
    status: str
    message: str
    fix: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.status in (OK, WARN, FAIL), self.status

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return asdict(self)

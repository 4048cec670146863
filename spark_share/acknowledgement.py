"""The acknowledgement kinds and what the broker answered to them: shared by the driver, which decides
each record's kind, and the executor, which sends it on the consumer that acquired the record.

Owns: ACCEPT, RELEASE, REJECT (confluent-kafka's ``AcknowledgeType`` values) and ``AckOutcome``, the
broker's answer counted by kind. Must never: import anything of spark_share but errors, or talk to a
socket, Kafka or Spark (plain data).
"""
from __future__ import annotations

from dataclasses import dataclass, field

ACCEPT, RELEASE, REJECT = 1, 2, 3


@dataclass
class AckOutcome:
    accepted: int = 0
    released: int = 0
    rejected: int = 0
    expired: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # error name/code -> records

    def add(self, other: AckOutcome) -> None:
        for k in ("accepted", "released", "rejected", "expired", "failed"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        for k, v in other.errors.items():
            self.errors[k] = self.errors.get(k, 0) + v

    def as_dict(self) -> dict:
        return {"accepted": self.accepted, "released": self.released, "rejected": self.rejected,
                "expired": self.expired, "failed": self.failed, "errors": dict(self.errors)}

    @classmethod
    def from_dict(cls, d: dict) -> AckOutcome:
        return cls(**{k: d.get(k, 0) for k in ("accepted", "released", "rejected", "expired", "failed")},
                   errors=dict(d.get("errors", {})))

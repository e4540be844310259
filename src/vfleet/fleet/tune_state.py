"""`vfleet tune`'s state file: every candidate tried on a host, so that a re-run resumes.

One JSON file (written whole: temp file + rename after every candidate, so a tune cut short
keeps everything measured before). A re-run with the same host, deployment and bench plan
skips every candidate it holds; the objective may change between runs (the raw figures are
kept, the ranking is recomputed). The host's own settings are kept only as a hash: they may
hold the API key.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from vfleet.errors import VfleetError
from vfleet.fleet.tune_measure import BenchPlan, Measurement, Objective

SCHEMA = 1
Status = Literal["measured", "skipped", "failed"]


@dataclass(frozen=True)
class Identity:
    """What makes two runs' measurements comparable."""

    host: str
    profile: str
    model: str
    instance: str
    settings_sha256: str  # of the host's own settings (vfleet_set): they may hold a key
    bench: BenchPlan

    @staticmethod
    def of(
        host: str, profile: str, model: str, instance: str, sets: list[str], bench: BenchPlan
    ) -> Identity:
        digest = hashlib.sha256(json.dumps(sorted(sets)).encode()).hexdigest()
        return Identity(host, profile, model, instance, digest, bench)


@dataclass
class Result:
    key: str  # the candidate: `depth=2 batched-tokens=4096`
    picks: dict[str, str]
    sets: list[str]
    status: Status
    why: str | None = None  # skipped: the rule or plan; failed: the swap's or bench's message
    measurement: Measurement | None = None
    release_id: str | None = None
    seconds: float = 0.0  # deploy + bench: what the budget is spent on
    at: str = ""  # when it was tried (UTC, ISO 8601)
    run: int = 1  # which tune run measured it (1 = the first; a resume counts up)


@dataclass
class State:
    identity: Identity
    runs: int = 0
    results: dict[str, Result] = field(default_factory=dict)

    def add(self, r: Result) -> None:
        r.at = r.at or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        r.run = self.runs
        self.results[r.key] = r

    def forget_failed(self) -> list[Result]:
        """Drop the failed candidates (a re-run tries them again); the ones dropped."""
        failed = [r for r in self.results.values() if r.status == "failed"]
        for r in failed:
            del self.results[r.key]
        return failed

    def scores(self, objective: Objective) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for key, r in self.results.items():
            out[key] = objective.score(r.measurement)[0] if r.measurement else None
        return out

    def winner(self, objective: Objective) -> Result | None:
        ranked = [(s, self.results[k]) for k, s in self.scores(objective).items() if s is not None]
        return max(ranked, key=lambda x: x[0])[1] if ranked else None

    def mean_candidate_s(self) -> float | None:
        spent = [r.seconds for r in self.results.values() if r.status != "skipped"]
        return sum(spent) / len(spent) if spent else None


def to_json(state: State) -> dict[str, Any]:
    return {"schema": SCHEMA, **asdict(state)}


def save(path: Path, state: State) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(to_json(state), indent=2) + "\n")
    os.replace(tmp, path)


def load(path: Path, identity: Identity) -> State:
    """The state to continue from: a fresh one when there is no file; the file's when it was
    written for the same host, deployment and bench plan; otherwise a clear error."""
    if not path.exists():
        return State(identity)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"schema {doc.get('schema')!r}, this vfleet writes {SCHEMA}")
        ident = doc["identity"]
        found = Identity(**{**ident, "bench": BenchPlan(**ident["bench"])})
        results = {
            k: Result(
                **{
                    **r,
                    "measurement": Measurement(**r["measurement"]) if r["measurement"] else None,
                }
            )
            for k, r in doc["results"].items()
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise VfleetError(
            f"not a tune state file: {exc}",
            where=str(path),
            key="--state",
            fix="pass another --state FILE (or remove this one to start over)",
        ) from None
    if found != identity:
        differ = [
            k for k in ("host", "profile", "model", "instance", "settings_sha256", "bench")
            if getattr(found, k) != getattr(identity, k)
        ]  # fmt: skip
        raise VfleetError(
            f"the state file was written for another tune (differs in: {', '.join(differ)})",
            where=str(path),
            key="--state",
            fix="use the same host, settings and bench options to resume, or pass a new --state",
        )
    return State(found, int(doc.get("runs", 0)), results)

"""Policy tables: which choice each stage takes at each token count.

The JSON form (``additional_config["policy"]``) maps a stage to one of
  - a choice string: that choice at every token count 1..MAX_TOKENS;
  - ``null`` / ``false``: the stock path at every token count;
  - a mapping from token counts (``8``, ``"8"``) or inclusive ranges (``"1-8"``), in ASCII
    digits, to a choice or ``null`` (stock at those counts).
A stage named in the user table replaces that stage's default entry whole; stages it does
not name keep the GPU family's default. JSON text may not repeat a key (``json.loads``
would keep the last one silently). ``strict_json`` refuses what JSON text cannot hold, a
token key that is not a string: vLLM hashes ``additional_config`` as
``json.dumps(..., sort_keys=True)``, which cannot order ``8`` beside ``"1-4"``. Every
problem is reported at once, with its key path, in one ``PolicyError`` (a ``ValueError``).
"""

from __future__ import annotations

import bisect
import json
import re
import reprlib
from collections.abc import Mapping
from importlib import resources
from itertools import pairwise
from types import MappingProxyType
from typing import Any

from .stages import FAMILIES, MAX_TOKENS, NOT_BUILT, STAGES

# (first, last, choice): an inclusive token range, sorted and disjoint within a stage.
Range = tuple[int, int, str]
_SPEC = re.compile(r"([0-9]+)(?:-([0-9]+))?")  # not \d: int() reads "１-８" as 1-8 too


class PolicyError(ValueError):
    """Bad decode configuration; ``problems`` lists each one with its key path."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(
            "invalid GLM-5.3-Flash decode configuration:\n"
            + "\n".join(f"  - {p}" for p in self.problems)
        )


class _Object(dict):
    """A JSON object as parsed, with the keys its text repeated (json.loads keeps the last)."""

    repeated: tuple[str, ...] = ()


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    if len(obj) < len(pairs):
        keys = [k for k, _ in pairs]
        obj.repeated = tuple(k for k in obj if keys.count(k) > 1)
    return obj


def loads(text: str) -> Any:
    """JSON text parsed as json.loads does, each object recording the keys its text repeated
    (`repeated`), which json.loads would drop but for the last. Raises ValueError."""
    return json.loads(text, object_pairs_hook=_object)


def _repeats(obj: Any, where: str, problems: list[str]) -> None:
    for key in getattr(obj, "repeated", ()):
        problems.append(f"{where}: key {key!r} given more than once (JSON keeps only the last)")


def _span(
    key: Any, where: str, problems: list[str], strict_json: bool = False
) -> tuple[int, int] | None:
    """The inclusive token range a table key names, or None after noting why not."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        problems.append(f"{where}: token key must be an integer or 'first-last', got {key!r}")
        return None
    if strict_json and not isinstance(key, str):
        problems.append(
            f"{where}: token key {key!r} is not a string (keys are JSON text: write '{key}')"
        )
        return None
    if isinstance(key, int):
        first = last = key
    else:
        match = _SPEC.fullmatch(key.strip())
        if match is None:
            problems.append(
                f"{where}: {key!r} is not a token count or 'first-last' range in ASCII digits"
            )
            return None
        first = int(match[1])
        last = int(match[2]) if match[2] is not None else first
    if first < 1 or last < 1:
        problems.append(f"{where}: token counts must be positive, got {key!r}")
        return None
    if first > last:
        problems.append(f"{where}: reversed range {key!r} (first > last)")
        return None
    if last > MAX_TOKENS:
        problems.append(f"{where}: {key!r} exceeds {MAX_TOKENS} tokens, the largest planned step")
        return None
    return first, last


def _choice(stage: str, value: Any, where: str, problems: list[str]) -> str | None:
    """A valid choice of `stage`, None for stock; notes a problem otherwise."""
    if value is None or value is False:
        return None
    if isinstance(value, str) and f"{stage}.{value}" in NOT_BUILT:
        problems.append(f"{where}: {value!r} is {NOT_BUILT[f'{stage}.{value}']}")
    elif not isinstance(value, str) or value not in STAGES[stage]:
        known = ", ".join(sorted(STAGES[stage]))
        shown = reprlib.repr(value)  # a deeply nested value must not recurse here
        problems.append(f"{where}: unknown choice {shown} (expects one of {known} or null)")
    return value if isinstance(value, str) else None


def _stage(
    stage: str, value: Any, where: str, problems: list[str], strict_json: bool = False
) -> tuple[Range, ...]:
    """One stage's table as canonical ranges (stock counts dropped, neighbours merged)."""
    if isinstance(value, Mapping):
        _repeats(value, where, problems)
        spans: list[tuple[int, int, str | None, Any]] = []
        for key, choice in value.items():
            at = f"{where}[{key!r}]"
            span = _span(key, at, problems, strict_json)
            picked = _choice(stage, choice, at, problems)
            if span is not None:
                spans.append((*span, picked, key))
        spans.sort(key=lambda s: s[:2])
        for (_, last, _, key), (first, _, _, other) in pairwise(spans):
            if first <= last:
                problems.append(f"{where}: ranges {key!r} and {other!r} overlap")
        items = [(a, b, c) for a, b, c, _ in spans if c is not None]
    elif value is None or value is False or isinstance(value, str):
        picked = _choice(stage, value, where, problems)
        items = [] if picked is None else [(1, MAX_TOKENS, picked)]
    else:
        problems.append(
            f"{where}: expects a choice, null, or a mapping of token counts to choices, "
            f"got {type(value).__name__}"
        )
        return ()
    merged: list[Range] = []
    for first, last, choice in items:
        if merged and merged[-1][2] == choice and merged[-1][1] + 1 == first:
            merged[-1] = (merged[-1][0], last, choice)
        else:
            merged.append((first, last, choice))
    return tuple(merged)


def parse_table(
    obj: Any, where: str = "policy", *, strict_json: bool = False
) -> dict[str, tuple[Range, ...]]:
    """The stages a JSON table names, each as canonical ranges. Raises PolicyError."""
    problems: list[str] = []
    table = _parse(obj, where, problems, strict_json)
    if problems:
        raise PolicyError(problems)
    return table


def _parse(
    obj: Any, where: str, problems: list[str], strict_json: bool = False
) -> dict[str, tuple[Range, ...]]:
    if isinstance(obj, str):
        try:
            obj = loads(obj)
        except json.JSONDecodeError as error:
            problems.append(f"{where}: not valid JSON ({error.msg} at char {error.pos})")
            return {}
        except RecursionError:
            problems.append(f"{where}: nested too deeply to be a policy table")
            return {}
    if obj is None:
        return {}
    if not isinstance(obj, Mapping):
        problems.append(f"{where}: expects a mapping of stage to table, got {type(obj).__name__}")
        return {}
    _repeats(obj, where, problems)
    table: dict[str, tuple[Range, ...]] = {}
    for stage, value in obj.items():
        at = f"{where}[{stage!r}]"
        if isinstance(stage, str) and stage in NOT_BUILT:
            problems.append(f"{at}: {NOT_BUILT[stage]}")
            continue
        if not isinstance(stage, str) or stage not in STAGES:
            known = ", ".join(sorted(STAGES))
            problems.append(f"{at}: unknown stage (known: {known})")
            continue
        table[stage] = _stage(stage, value, at, problems, strict_json)
    return table


def default_table(family: str) -> dict[str, tuple[Range, ...]]:
    """The shipped default table of a GPU family ('sm90', 'sm100')."""
    if family not in FAMILIES:
        raise PolicyError([f"family: unknown GPU family {family!r} (known: {', '.join(FAMILIES)})"])
    text = resources.files(__package__).joinpath(f"defaults/{family}.json").read_text()
    return parse_table(text, where=f"defaults/{family}.json")


class Policy:
    """Immutable, hashable per-stage routing over token counts.

    ``policy(stage, tokens)`` -> the choice, or None for the stock path;
    ``enabled(stage)``; ``tokens(stage, choice)``; ``tables[stage]`` -> {tokens: choice}.
    """

    __slots__ = ("_by_stage", "_ranges", "_starts", "_tables")

    def __init__(self, ranges: Mapping[str, tuple[Range, ...]] | None = None):
        problems: list[str] = []
        checked: dict[str, tuple[Range, ...]] = {}
        for stage, items in (ranges or {}).items():
            if stage not in STAGES:
                problems.append(f"policy[{stage!r}]: unknown stage")
                continue
            value = {f"{a}-{b}": c for a, b, c in items}
            checked[stage] = _stage(stage, value, f"policy[{stage!r}]", problems)
        if problems:
            raise PolicyError(problems)
        ranges_ = tuple(sorted((s, r) for s, r in checked.items() if r))
        by_stage = dict(ranges_)
        tables = {
            stage: MappingProxyType(
                {t: c for a, b, c in by_stage.get(stage, ()) for t in range(a, b + 1)}
            )
            for stage in STAGES
        }
        # Frozen: vLLM hashes additional_config, and a policy is shared across captures.
        object.__setattr__(self, "_ranges", ranges_)
        object.__setattr__(self, "_by_stage", by_stage)
        object.__setattr__(self, "_starts", {s: [a for a, _, _ in r] for s, r in ranges_})
        object.__setattr__(self, "_tables", MappingProxyType(tables))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Policy is immutable")

    @classmethod
    def from_json(cls, obj: Any = None, family: str | None = None) -> Policy:
        """`obj` (a mapping or JSON text) merged over `family`'s default table."""
        problems: list[str] = []
        table = _parse(obj, "policy", problems)
        base: dict[str, tuple[Range, ...]] = {}
        if family is not None:
            try:
                base = default_table(family)
            except PolicyError as error:
                problems.extend(error.problems)
        if problems:
            raise PolicyError(problems)
        return cls({**base, **table})

    @classmethod
    def default(cls, family: str) -> Policy:
        return cls(default_table(family))

    def __call__(self, stage: str, tokens: int) -> str | None:
        ranges = self._lookup(stage)
        i = bisect.bisect_right(self._starts.get(stage, []), tokens) - 1
        if i >= 0 and tokens <= ranges[i][1]:
            return ranges[i][2]
        return None

    def enabled(self, stage: str) -> bool:
        return bool(self._lookup(stage))

    def tokens(self, stage: str, choice: str) -> frozenset[int]:
        """The token counts at which `stage` takes `choice`."""
        if choice not in STAGES.get(stage, ()):
            self._lookup(stage)
            raise PolicyError([f"{stage}: unknown choice {choice!r}"])
        return frozenset(t for t, c in self._tables[stage].items() if c == choice)

    @property
    def tables(self) -> Mapping[str, Mapping[int, str]]:
        return self._tables

    def to_json(self) -> dict[str, Any]:
        """Every stage in canonical JSON form; `Policy.from_json` of it is this policy."""
        ranges = self._by_stage
        return {
            stage: (
                {(f"{a}" if a == b else f"{a}-{b}"): c for a, b, c in ranges[stage]}
                if stage in ranges
                else None
            )
            for stage in STAGES
        }

    def _lookup(self, stage: str) -> tuple[Range, ...]:
        if stage not in STAGES:
            raise PolicyError([f"{stage!r}: unknown stage"])
        return self._by_stage.get(stage, ())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and self._ranges == other._ranges

    def __hash__(self) -> int:
        return hash(self._ranges)

    def __repr__(self) -> str:
        return f"Policy({json.dumps({s: v for s, v in self.to_json().items() if v})})"

"""DecodeConfig: the deployment's specialized decode settings, validated whole."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .stages import MAX_TOKENS
from .table import Policy, PolicyError, _parse, default_table

# 1 + num_speculative_tokens: MTP verify steps up to 7 drafted tokens.
MAX_Q = 8


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """max_context: the longest sequence; q: tokens per request per step (1 + drafts);
    capture_sizes: the CUDA-graph token counts; policy: the resolved stage routing."""

    max_context: int
    q: int
    capture_sizes: tuple[int, ...]
    policy: Policy

    def __post_init__(self) -> None:
        problems = _check_fields(self.max_context, self.q, self.capture_sizes)
        if not isinstance(self.capture_sizes, tuple):
            problems.append("capture_sizes: must be a tuple (use DecodeConfig.build)")
        if not isinstance(self.policy, Policy):
            problems.append(f"policy: expects a Policy, got {type(self.policy).__name__}")
        if problems:
            raise PolicyError(problems)

    @property
    def planned_tokens(self) -> tuple[int, ...]:
        """Captured token counts the specialized decode plans: whole requests of q tokens,
        at most MAX_TOKENS."""
        return tuple(b for b in self.capture_sizes if b <= MAX_TOKENS and b % self.q == 0)

    @classmethod
    def build(
        cls,
        max_context: Any,
        q: Any = 1,
        capture_sizes: Any = (),
        policy: Any = None,
        family: str | None = None,
        *,
        strict_json: bool = False,
    ) -> DecodeConfig:
        """From plain values (e.g. vLLM's config and ``additional_config["policy"]``);
        one PolicyError names every problem in any of them. `strict_json`: the policy's
        token keys must be strings, as in JSON text (what vLLM's config hash needs)."""
        problems = _check_fields(max_context, q, capture_sizes)
        table = {}
        if isinstance(policy, Policy):
            resolved: Policy | None = policy
        else:
            resolved = None
            table = _parse(policy, "policy", problems, strict_json)
        base = {}
        if family is not None and resolved is None:
            try:
                base = default_table(family)
            except PolicyError as error:
                problems.extend(error.problems)
        if problems:
            raise PolicyError(problems)
        sizes = tuple(sorted(set(capture_sizes)))
        return cls(max_context, q, sizes, resolved or Policy({**base, **table}))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_fields(max_context: Any, q: Any, capture_sizes: Any) -> list[str]:
    problems = []
    if not _is_count(max_context):
        problems.append(f"max_context: expects a positive integer, got {max_context!r}")
    if not _is_count(q) or q > MAX_Q:
        problems.append(f"q: expects an integer in 1..{MAX_Q} (1 + drafted tokens), got {q!r}")
    if isinstance(capture_sizes, (str, bytes)) or not isinstance(capture_sizes, Iterable):
        problems.append(f"capture_sizes: expects a sequence of token counts, got {capture_sizes!r}")
    else:
        for i, size in enumerate(capture_sizes):
            if not _is_count(size):
                problems.append(f"capture_sizes[{i}]: expects a positive integer, got {size!r}")
    return problems

"""kvharbor's log lines as the source states them, read statically with `ast`, and a matcher
for lines quoted in the docs.

A *template* is a message with its variable parts as holes (`HOLE`): the holes of a
%-format (``%s``, ``%d``, ``%.2f``, ...) and of an f-string. A log call's template is
the whole line as the user reads it, ``kvharbor: `` included (written out, through
``PREFIX``, or added by `OnceLog.say`).

A *citation* is a line quoted in a document, with ``…`` (or ``...``, or ``<word>``)
where the line has a variable part. It matches a log template when its literal text
is the template's, hole for hole; a citation ending in a hole may stop part-way. What a
template's hole holds in a citation (a composite line: "refuses to start: <reason>")
must be a hole itself or, recursively, the text of a string literal of kvharbor.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import kvharbor
from kvharbor.telemetry.log import PREFIX

PACKAGE = Path(kvharbor.__file__).parent
HOLE = "\0"
LEVELS = frozenset({"debug", "info", "warning", "error", "exception", "critical", "log"})
_PERCENT_HOLE = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\d+|\*)?(?:\.\d+)?[sdrfgiuxXeEc]")
_CITED_HOLE = re.compile(r"…|\.\.\.|<[A-Za-z][\w .-]*>")
_FILLER = " '\"()[]{},.;:=-" + HOLE
_RECURSION_MAX = 2


@dataclass(frozen=True)
class LogCall:
    """One call that writes a log line, where it is and what it says."""

    where: str
    """``path:line`` relative to the package's parent."""
    template: str | None
    """The line with `HOLE` for variable parts, starting with `PREFIX`; None when the
    source does not show that the line starts with it."""


def _is_logger(receiver: ast.expr) -> bool:
    text = ast.unparse(receiver)
    return text == "logging" or text.endswith(("_log", "logger", "getLogger()")) or "getLogger(" in text


def _is_once_log(receiver: ast.expr) -> bool:
    return ast.unparse(receiver).endswith("once")


def _percent_template(text: str) -> str:
    return _PERCENT_HOLE.sub(HOLE, text).replace("%%", "%")


def template_of(node: ast.expr) -> str | None:
    """The template of a string expression, or None when it is not a static string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                parts.append(value.value)
            else:
                parts.append(HOLE)
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        # ``PREFIX + message``: what follows a static start may be any text.
        left, right = _prefix_or_template(node.left), template_of(node.right)
        return None if left is None else left + (HOLE if right is None else right)
    return None


def _prefix_or_template(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name) and node.id == "PREFIX":
        return PREFIX
    return template_of(node)


def _logged_template(call: ast.Call, message_index: int) -> str | None:
    """The line a ``logger.<level>(msg, *args)`` call writes, or None if it does not
    visibly start with the prefix."""
    if len(call.args) <= message_index:
        return None
    message = call.args[message_index]
    template = template_of(message)
    if template is None:
        return None
    if isinstance(message, ast.Constant):
        args = call.args[message_index + 1 :]
        template = _percent_template(template)
        if template.startswith(HOLE) and args and isinstance(args[0], ast.Name) and args[0].id == "PREFIX":
            template = PREFIX + template[1:]
    return template if template.startswith(PREFIX) else None


def _calls(tree: ast.AST) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node


def _sources() -> Iterator[tuple[str, ast.AST]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield str(path.relative_to(PACKAGE.parent)), ast.parse(path.read_text(), str(path))


@functools.cache
def log_calls() -> tuple[LogCall, ...]:
    """Every call in kvharbor that writes a log line: logger calls and `OnceLog.say`."""
    return tuple(call for where, tree in _sources() for call in log_calls_in(where, tree))


def log_calls_in(where: str, tree: ast.AST) -> list[LogCall]:
    """The calls in one module's syntax tree that write a log line."""
    found = []
    for call in _calls(tree):
        assert isinstance(call.func, ast.Attribute)
        method, receiver = call.func.attr, call.func.value
        if method in LEVELS and _is_logger(receiver):
            template = _logged_template(call, 1 if method == "log" else 0)
        elif method == "say" and _is_once_log(receiver) and len(call.args) >= 2:
            said = template_of(call.args[1])
            # OnceLog adds the prefix; a message that brings its own would say it twice.
            template = None if said is None or said.startswith(PREFIX.strip()) else PREFIX + said
        else:
            continue
        found.append(LogCall(f"{where}:{call.lineno}", template))
    return found


@functools.cache
def literals() -> tuple[str, ...]:
    """Every string literal and f-string of kvharbor as a template (reasons, error texts)."""
    found: set[str] = set()
    for _, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                template = template_of(node)
                if template and template.strip(_FILLER):
                    found.add(_percent_template(template))
    return tuple(sorted(found))


def citation(text: str) -> str:
    """A quoted line as a template: its ``…``, ``...`` and ``<word>`` parts as holes."""
    return _CITED_HOLE.sub(HOLE, text)


def _alignments(template: str, text: str) -> Iterator[list[str]]:
    """What each hole of ``template`` holds when ``text`` (a citation) is read as it; a
    citation ending in a hole may stop anywhere in the template. Each literal part is
    taken at its first place after the previous one (a wildcard match)."""
    parts = template.split(HOLE)
    truncated = text.endswith(HOLE)
    body = text[:-1] if truncated else text
    if not body.startswith(parts[0]):
        if truncated and parts[0].startswith(body):
            yield []
        return
    pos, held = len(parts[0]), list[str]()
    for index, part in enumerate(parts[1:], start=1):
        last = index == len(parts) - 1
        found = body.find(part, pos)
        if last and not truncated:
            if body.endswith(part) and len(body) - len(part) >= pos:
                yield [*held, body[pos : len(body) - len(part)]]
            return
        if found < 0 or last:
            if truncated:  # The citation stops in this hole, or part-way into the literal after it.
                rest = body[pos:]
                for cut in range(min(len(rest), len(part)), 0, -1):
                    if part.startswith(rest[len(rest) - cut :]):
                        yield [*held, rest[: len(rest) - cut]]
                yield [*held, rest + HOLE]
            return
        held.append(body[pos:found])
        pos = found + len(part)
    if pos == len(body):
        yield held


def _fits(text: str, template: str, depth: int) -> bool:
    return any(all(_hole_holds(h, depth) for h in held) for held in _alignments(template, text))


def _hole_holds(held: str, depth: int) -> bool:
    """Is what a template's hole holds in a citation a hole, or a literal of kvharbor?"""
    if not held.strip(_FILLER):
        return True
    inner = held.strip(" ")
    if depth >= _RECURSION_MAX or inner.startswith(HOLE):
        return False  # Text after an unknown start cannot be placed: quote the start of what it holds.
    return any(_fits(inner, literal, depth + 1) for literal in literals() if _could_start(inner, literal))


def _could_start(text: str, template: str) -> bool:
    """A cheap filter: the literal starts of both agree as far as both go."""
    n = min(text.find(HOLE) % (len(text) + 1), template.find(HOLE) % (len(template) + 1), 12)
    return n > 0 and text[:n] == template[:n]


@functools.cache
def lines() -> tuple[str, ...]:
    """The templates of every line kvharbor writes: its log calls, and the messages that
    start with the prefix by themselves (errors an engine shows, such as a refused start)."""
    logged = {call.template for call in log_calls() if call.template is not None}
    written = {literal for literal in literals() if literal.startswith(PREFIX)}
    # ``PREFIX + message`` and ``"kvharbor: %s"`` match a line whose message is a literal of
    # kvharbor (what a hole holds is checked): the message's own call site is elsewhere.
    return tuple(sorted(logged | written))


def cited_line_exists(text: str) -> bool:
    """Does kvharbor write the line ``text`` (a citation)?"""
    cited = citation(text)
    return any(_fits(cited, line, 0) for line in lines() if _could_start(cited, line))

"""The engine uses a target through its contract alone (``applier.targets.contract``).

Read from the source of ``applier/engine/``: a target (a name ``target`` or an attribute ``….target``) is never
typed ``Any``, nothing is assigned on it after it is built, and every attribute read on it is a member of the
``Target`` Protocol (no ``target.conn``, ``target.sql``, …).
"""

from __future__ import annotations

import ast
from pathlib import Path

import applier
from applier.targets.contract import Target

ENGINE = Path(applier.__file__).resolve().parent / "engine"
CONTRACT = frozenset(name for name in dir(Target) if not name.startswith("_"))


def _is_target(node: ast.expr) -> bool:
    """``target`` or ``<anything>.target``."""
    return (isinstance(node, ast.Name) and node.id == "target") or (
        isinstance(node, ast.Attribute) and node.attr == "target")


def _is_any(node: ast.expr | None) -> bool:
    return (isinstance(node, ast.Name) and node.id == "Any") or (
        isinstance(node, ast.Constant) and node.value == "Any")


def past_the_contract(source: str) -> list[str]:
    """Each use of a target in ``source`` that goes past the contract, as ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        typed = ((isinstance(node, ast.arg) and node.arg == "target")
                 or (isinstance(node, ast.AnnAssign) and _is_target(node.target)))
        if typed and _is_any(node.annotation):
            found.append(f"{node.lineno}: target typed Any")
        elif isinstance(node, ast.Attribute) and _is_target(node.value):
            if isinstance(node.ctx, (ast.Store, ast.Del)):
                found.append(f"{node.lineno}: target.{node.attr} set")
            elif node.attr not in CONTRACT:
                found.append(f"{node.lineno}: target.{node.attr} is not in the contract")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and node.args and _is_target(node.args[0])):
            found.append(f"{node.lineno}: setattr on target")
    return found


def test_the_engine_uses_a_target_through_its_contract_alone() -> None:
    uses = {path.name: past_the_contract(path.read_text()) for path in sorted(ENGINE.glob("*.py"))}
    assert {name: found for name, found in uses.items() if found} == {}


def test_a_use_past_the_contract_is_found() -> None:
    source = (
        "from typing import Any\n"
        "def session(target: Any) -> None:\n"
        "    target.slot = 'x'\n"
        "    n = prune(target.conn, target.sql)\n"
        "    target.commit(0)\n"
        "class E:\n"
        "    def f(self) -> None:\n"
        "        self.target.pipelined = True\n"
        "        setattr(self.target, 'money_text', None)\n"
    )
    assert past_the_contract(source) == [
        "2: target typed Any", "3: target.slot set", "4: target.conn is not in the contract",
        "4: target.sql is not in the contract", "8: target.pipelined set", "9: setattr on target"]

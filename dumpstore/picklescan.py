"""Budgets for an untrusted pickle, checked on its opcodes before the unpickler builds anything.

A pickle a few hundred bytes long can describe a structure of 2**40 logical leaves (a list holding the same list
twice, forty times over, through the memo), which anything that walks it (hashing a dict key, repr, comparison)
never finishes; or name a memo slot 2**32 that makes the C unpickler allocate gigabytes. :func:`check_pickle`
simulates the unpickler's stack without building objects and refuses, in one line, a pickle with too many opcodes,
too large a memo index, too deep a nesting, or a logical size (shared parts counted each time they are used) over
the budget. A plain tensor or numpy array pickle is a few dozen opcodes, nests four deep and weighs under a hundred.
"""

from __future__ import annotations

import pickletools
import struct

MAX_OPS = 100_000  # opcodes
MAX_MEMO = 1 << 16  # highest memo index
MAX_NEST = 32  # containers inside containers
MAX_MARKS = 64  # open MARKs at once
MAX_WEIGHT = 1_000_000  # logical objects, shared ones counted at every use


class PickleBudgetError(ValueError):
    """The pickle exceeds a budget (the message is one line and renders nothing from the pickle)."""


class _Node:
    """What the unpickler would have on its stack: its logical size, nesting, and whether it is part of another
    object yet (a container must not change once it is: that could grow every copy already counted)."""

    __slots__ = ("depth", "sealed", "weight")

    def __init__(self, weight: int = 1, depth: int = 0) -> None:
        self.weight, self.depth, self.sealed = weight, depth, False


_MARK = object()
_MUTATORS = {"APPEND": 1, "SETITEM": 2, "BUILD": 1, "APPENDS": -1, "SETITEMS": -1, "ADDITEMS": -1}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}
_GETS = {"GET", "BINGET", "LONG_BINGET"}
# opcode byte -> (name, argument size or kind, MARK position in its inputs or -1, inputs, outputs)
_OPS = {
    ord(code): (
        op.name,
        None if op.arg is None else op.arg.n,
        next((i for i, x in enumerate(op.stack_before) if x.name == "mark"), -1),
        len(op.stack_before),
        len(op.stack_after),
    )
    for code, op in pickletools.code2op.items()  # type: ignore[attr-defined]
}
_LENGTH = {-2: struct.Struct("<B"), -3: struct.Struct("<i"), -4: struct.Struct("<I"), -5: struct.Struct("<Q")}


def check_pickle(data: bytes | memoryview) -> None:
    """Raise PickleBudgetError unless `data` (one pickle) stays within the budgets; ValueError if malformed."""
    _Scan(memoryview(data).cast("B")).run()


class _Scan:
    def __init__(self, data: memoryview) -> None:
        self.data, self.pos = data, 0
        self.stack: list = []
        self.memo: dict[int, _Node] = {}
        self.marks = 0

    def run(self) -> None:
        for _ in range(MAX_OPS):
            op = self._opcode()
            arg = self._arg(op)
            if op[0] == "STOP":
                if len(self.stack) != 1 or self.stack[0] is _MARK:
                    raise ValueError("pickle stack does not end with one object")
                return
            self._apply(op[0], op, arg)
        raise PickleBudgetError(f"pickle has more than {MAX_OPS} opcodes")

    # -- reading ---------------------------------------------------------------------------------------------
    def _opcode(self) -> tuple:
        if self.pos >= len(self.data):
            raise ValueError("pickle ends without STOP (truncated)")
        code = self.data[self.pos]
        self.pos += 1
        op = _OPS.get(code)
        if op is None:
            raise ValueError(f"unknown pickle opcode 0x{code:02x}")
        return op

    def _arg(self, op: tuple) -> int | None:
        """Skip the opcode's argument; return it when it is a memo index (the only one the scan needs)."""
        name, n = op[0], op[1]
        if n is None:
            return None
        if n >= 0:
            raw = self._take(n)
            if name in ("BINPUT", "BINGET", "LONG_BINPUT", "LONG_BINGET"):
                return int.from_bytes(raw, "little")
            return None
        if n == -1:  # up to a newline (GLOBAL and INST: two lines)
            line = self._line()
            if name in ("GLOBAL", "INST"):
                self._line()
            if name in ("PUT", "GET"):
                try:
                    return int(line)
                except ValueError:
                    raise ValueError("corrupt memo index in pickle") from None
            return None
        size = _LENGTH[n]
        length = size.unpack(self._take(size.size))[0]
        if length < 0:
            raise ValueError("negative length in pickle")
        self._take(length)
        return None

    def _take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            raise ValueError("pickle is truncated")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def _line(self) -> bytes:
        start = self.pos
        while True:
            chunk = bytes(self.data[self.pos : self.pos + 4096])
            if not chunk:
                raise ValueError("pickle is truncated")
            at = chunk.find(b"\n")
            if at >= 0:
                self.pos += at + 1
                return bytes(self.data[start : self.pos - 1])
            self.pos += len(chunk)

    # -- the stack -------------------------------------------------------------------------------------------
    def _apply(self, name: str, op: tuple, arg: int | None) -> None:
        if name in _PUTS:
            index = len(self.memo) if name == "MEMOIZE" else arg
            if index is None or index < 0 or index > MAX_MEMO:
                raise PickleBudgetError(f"pickle memo index over {MAX_MEMO}")
            self.memo[index] = self._top()
        elif name in _GETS:
            if arg not in self.memo:
                raise ValueError("pickle reads a memo slot it never wrote")
            self._push(self.memo[arg])
        elif name in _MUTATORS:
            items = self._pop_to_mark() if _MUTATORS[name] < 0 else [self._pop() for _ in range(_MUTATORS[name])]
            self._grow(self._top(), items)
        elif name == "MARK":
            self.marks += 1
            if self.marks > MAX_MARKS:
                raise PickleBudgetError(f"pickle opens more than {MAX_MARKS} MARKs at once")
            self.stack.append(_MARK)
        elif name == "DUP":
            self._push(self._top())
        elif name == "POP":
            if self.stack and self.stack[-1] is _MARK:
                self._pop_to_mark()
            else:
                self._pop()
        elif name == "POP_MARK":
            self._pop_to_mark()
        elif name not in ("PROTO", "FRAME"):
            self._build(op)

    def _build(self, op: tuple) -> None:
        """Any other opcode: pops its inputs, pushes what it makes (made of them)."""
        _name, _n, mark, n_before, n_after = op
        if mark >= 0:
            items = self._pop_to_mark()
            items += [self._pop() for _ in range(mark)]
        else:
            items = [self._pop() for _ in range(n_before)]
        for _ in range(n_after):
            node = _Node()
            if items:
                self._grow(node, items)
            self.stack.append(node)

    def _grow(self, node: _Node, items: list[_Node]) -> None:
        if node.sealed and items:
            raise ValueError("pickle changes an object after using it (not a plain tensor pickle)")
        for item in items:
            item.sealed = True
            node.weight += item.weight
            node.depth = max(node.depth, item.depth + 1)
        if node.weight > MAX_WEIGHT:
            raise PickleBudgetError(
                f"pickle describes more than {MAX_WEIGHT} objects (shared parts counted at every use)"
            )
        if node.depth > MAX_NEST:
            raise PickleBudgetError(f"pickle nests more than {MAX_NEST} levels")

    def _top(self) -> _Node:
        if not self.stack or self.stack[-1] is _MARK:
            raise ValueError("pickle stack underflow")
        return self.stack[-1]

    def _pop(self) -> _Node:
        node = self._top()
        self.stack.pop()
        return node

    def _push(self, node: _Node) -> None:
        self.stack.append(node)

    def _pop_to_mark(self) -> list[_Node]:
        items: list[_Node] = []
        while self.stack and self.stack[-1] is not _MARK:
            items.append(self.stack.pop())
        if not self.stack:
            raise ValueError("pickle stack has no MARK")
        self.stack.pop()
        self.marks -= 1
        return items

"""Feature formulas as expression graphs: a family writes its formulas once, as `Expr`s, and
every form is derived from that one graph:

    numpy      `Evaluator`: the feature engine's values, vectorized over kernels
    C          tilecast.runtime.export.program: the exported selector's statements
    C++        tilecast.runtime.native.codegen: the native scorer's generated header

An operation means the same in each: OPS holds its arity, its float64 meaning here (scalar
and numpy) and its C spellings, so the forms can only differ where the table says how.
Python's operator precedence builds the same tree as the numpy expression it replaces, and
IEEE float64 evaluation in the same order gives the same bits everywhere.

Leaves: a problem field (`problem_field`, the selector's argument), a kernel column
(`kernel_column`, a column of the engine's kernel_features) and a hardware feature
(`hardware_field`, a HARDWARE_FEATURES value: a constant of the exported selector, an
argument of the native code).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np


# The scalar forms give numpy's values on Python floats, NaN and division by zero included.
def _minimum(a: float, b: float) -> float:
    return a if a <= b or a != a else b   # np.minimum: NaN propagates


def _maximum(a: float, b: float) -> float:
    return a if a >= b or a != a else b


def _ceil_div(a: float, b: float) -> float:
    # -(-a // b), with numpy's (and Python's) float floor division; numpy's a / 0 for b == 0
    if b == 0.0:
        with np.errstate(divide="ignore", invalid="ignore"):
            return float(-np.floor_divide(-a, b))
    return -((-a) // b)


def _floor_div(a: float, b: float) -> float:
    # Python's float floor division is numpy's (both from fmod); numpy's a / 0 for b == 0
    if b == 0.0:
        with np.errstate(divide="ignore", invalid="ignore"):
            return float(np.floor_divide(a, b))
    return a // b


def _log2(a: float) -> float:
    # numpy's own log2 (its SIMD loops can differ from the C library's in the last bit)
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.log2(a))


def _exp2(a: float) -> float:
    # 2.0 ** a on a numpy float64: numpy's scalar power, the C library's pow
    with np.errstate(over="ignore", invalid="ignore"):
        return float(2.0 ** np.float64(a))


@dataclass(frozen=True)
class Op:
    """One operation: its arity, its meaning on Python floats and on numpy arrays, and its C
    spellings ({0}, {1}... are the operands, already parenthesized where needed): `c` for
    the exported selector, whose problems the family has validated, and `cpp` for the native
    scorer, numpy's semantics on any float64 (helpers of gemm_features.cpp)."""
    arity: int
    evaluate: Callable[..., float]
    numpy: Callable
    c_template: str
    cpp_template: str


def _binary(c: str) -> tuple[str, str]:
    return c, c


# The single table of operations. ceil_div's and floor_div's C forms are for whole-number
# operands below 2**53 (every count of a problem the exported selector accepts), where
# floor(a / b) equals numpy's floor division; ceil_div's C++ form checks that per operation
# (tc_ceil_div) and falls back to numpy's algorithm. log2 and exp2 are numpy's (exp2: numpy's
# scalar power, the C library's pow); their C forms call the C library, whose log2 can differ
# from numpy's SIMD log2 in the last bit (tilecast.runtime.export.grouped_conv says where
# that reaches a feature). The native scorer (GEMM's) uses none of the three.
OPS: dict[str, Op] = {
    "add": Op(2, lambda a, b: a + b, lambda a, b: a + b, *_binary("({0} + {1})")),
    "sub": Op(2, lambda a, b: a - b, lambda a, b: a - b, *_binary("({0} - {1})")),
    "mul": Op(2, lambda a, b: a * b, lambda a, b: a * b, *_binary("({0} * {1})")),
    "div": Op(2, lambda a, b: a / b, lambda a, b: a / b, *_binary("({0} / {1})")),
    "neg": Op(1, lambda a: -a, lambda a: -a, *_binary("(-{0})")),
    "min": Op(2, _minimum, np.minimum, "({0} <= {1} ? {0} : {1})", "tc_minimum({0}, {1})"),
    "max": Op(2, _maximum, np.maximum, "({0} >= {1} ? {0} : {1})", "tc_maximum({0}, {1})"),
    "ceil_div": Op(2, _ceil_div, lambda a, b: -np.floor_divide(-a, b),
                   "(-floor(-{0} / {1}))", "tc_ceil_div<fast>({0}, {1}, whole)"),
    "floor_div": Op(2, _floor_div, np.floor_divide, "floor({0} / {1})",
                    "std::floor({0} / {1})"),
    "log2": Op(1, _log2, np.log2, "log2({0})", "std::log2({0})"),
    "exp2": Op(1, _exp2, lambda a: 2.0 ** a, "pow(2.0, {0})", "std::pow(2.0, {0})"),
    "eq": Op(2, lambda a, b: 1.0 if a == b else 0.0, lambda a, b: np.where(a == b, 1.0, 0.0),
             *_binary("({0} == {1} ? 1.0 : 0.0)")),
    "gt": Op(2, lambda a, b: 1.0 if a > b else 0.0, lambda a, b: np.where(a > b, 1.0, 0.0),
             *_binary("({0} > {1} ? 1.0 : 0.0)")),
    "select": Op(3, lambda c, a, b: a if c != 0.0 else b,
                 lambda c, a, b: np.where(c != 0.0, a, b), *_binary("({0} != 0.0 ? {1} : {2})")),
}
LEAVES = ("input", "kernel", "hardware", "const")


@dataclass(eq=False)
class Expr:
    """A node of the graph: a leaf of LEAVES or an operation of OPS over other nodes. Nodes
    are compared by identity: a node used twice is computed once."""
    op: str
    args: tuple["Expr", ...] = ()
    name: str = ""
    value: float = 0.0

    def __add__(self, other): return Expr("add", (self, lift(other)))
    def __radd__(self, other): return Expr("add", (lift(other), self))
    def __sub__(self, other): return Expr("sub", (self, lift(other)))
    def __rsub__(self, other): return Expr("sub", (lift(other), self))
    def __mul__(self, other): return Expr("mul", (self, lift(other)))
    def __rmul__(self, other): return Expr("mul", (lift(other), self))
    def __truediv__(self, other): return Expr("div", (self, lift(other)))
    def __rtruediv__(self, other): return Expr("div", (lift(other), self))
    def __neg__(self): return Expr("neg", (self,))


def lift(value) -> Expr:
    """An Expr as it is; a number as a constant node."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(float(value)):
        raise TypeError(f"a formula constant must be a finite number, got {value!r}")
    return Expr("const", value=float(value))


def problem_field(name: str) -> Expr:
    return Expr("input", name=name)


def kernel_column(name: str) -> Expr:
    return Expr("kernel", name=name)


def hardware_field(name: str) -> Expr:
    return Expr("hardware", name=name)


def apply(op: str, *args) -> Expr:
    """The node applying OPS[op] to `args` (numbers become constants)."""
    if op not in OPS or OPS[op].arity != len(args):
        raise ValueError(f"unknown operation {op!r} with {len(args)} operand(s); "
                         f"valid: {', '.join(OPS)}")
    return Expr(op, tuple(lift(a) for a in args))


def topological(outputs: Mapping[str, Expr]) -> list[Expr]:
    """Every node the outputs need, each once, operands before the nodes that read them."""
    order, seen = [], set()
    for root in outputs.values():
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in seen:
                continue
            if expanded or not node.args:
                seen.add(id(node))
                order.append(node)
                continue
            stack.append((node, True))
            stack.extend((arg, False) for arg in reversed(node.args) if id(arg) not in seen)
    return order


@dataclass(frozen=True)
class Formula:
    """A feature: its graph, and whether the feature is np.log2 of the graph (the exported
    selector and the native code keep the argument; see tilecast.runtime.export.forest)."""
    graph: Expr
    log2: bool = False


class Evaluator:
    """The numpy form of a set of formulas: `values(inputs, kernels, hardware)` gives each
    output's value, a scalar for a formula of no kernel column, else one per kernel.
    The graph is sorted once; a call runs its nodes in order, those of no kernel column on
    Python floats (OPS' scalar form: the same IEEE operations, without numpy's per-call
    cost), the others on arrays."""

    def __init__(self, outputs: Mapping[str, Formula]):
        graphs = {name: formula.graph for name, formula in outputs.items()}
        self._nodes = topological(graphs)
        index = {id(node): i for i, node in enumerate(self._nodes)}
        per_kernel: set[int] = set()
        for node in self._nodes:
            if node.op == "kernel" or any(id(arg) in per_kernel for arg in node.args):
                per_kernel.add(id(node))
        self._steps = [(OPS[node.op].numpy if id(node) in per_kernel else OPS[node.op].evaluate,
                        tuple(index[id(arg)] for arg in node.args))
                       if node.op in OPS else None for node in self._nodes]
        self._outputs = [(name, index[id(formula.graph)], formula.log2)
                         for name, formula in outputs.items()]

    def values(self, inputs: Mapping[str, float], kernels: Mapping[str, np.ndarray],
               hardware: Mapping[str, float]) -> list:
        """The outputs' values in their order (log2 applied)."""
        leaves = {"input": inputs, "kernel": kernels, "hardware": hardware}   # floats, arrays
        values: list = [None] * len(self._nodes)
        for i, (node, step) in enumerate(zip(self._nodes, self._steps)):
            if step is not None:
                function, args = step
                values[i] = function(*(values[a] for a in args))
            elif node.op == "const":
                values[i] = node.value
            else:
                values[i] = leaves[node.op][node.name]
        return [np.log2(values[i]) if log2 else values[i] for _, i, log2 in self._outputs]

    def block(self, count: int, inputs, kernels, hardware) -> np.ndarray:
        """A (count, outputs) float64 block, a scalar output broadcast down its column."""
        outputs = self.values(inputs, kernels, hardware)
        block = np.empty((count, len(outputs)), dtype=np.float64)
        for column, value in enumerate(outputs):
            block[:, column] = value
        return block

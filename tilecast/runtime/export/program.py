"""Feature formulas as an expression graph that can be evaluated here and printed as C.

A family's exporter writes its engine's problem and interaction features with `Expr`s, in
the same operation order as the numpy engine (Python's operator precedence builds the same
tree), so that IEEE float64 evaluation gives the same bits in Python, in the exported C and
in any runtime that reads the JSON form. `compile_program` sorts the graph into levels:

    const    no problem field, no kernel column: folded here
    kernel   kernel columns only: evaluated here once per kernel, stored in a table
    problem  problem fields only: computed once per query
    mixed    both: computed per candidate

and keeps only the statements the model's features need.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

LEVELS = ("const", "kernel", "problem", "mixed")


def _minimum(a: float, b: float) -> float:
    # np.minimum (no NaN reaches a formula; both agree with Python's min on values)
    return a if a <= b else b


def _maximum(a: float, b: float) -> float:
    return a if a >= b else b


def _ceil_div(a: float, b: float) -> float:
    # the engines' _ceil_div: -(-a // b), with numpy's (and Python's) float floor division
    return -((-a) // b)


@dataclass(frozen=True)
class Op:
    """One operation: its arity, its Python meaning and its C spelling ({0}, {1}... are the
    operands, already parenthesized where needed)."""
    arity: int
    evaluate: Callable[..., float]
    c_template: str


# The single table of operations: the exported C, the JSON form and the evaluation here all
# dispatch through it. ceil_div is for whole-number operands below 2**53 (every GEMM count
# is: the family bounds problem sizes), where -floor(-a / b) equals numpy's floor division.
OPS: dict[str, Op] = {
    "add": Op(2, lambda a, b: a + b, "({0} + {1})"),
    "sub": Op(2, lambda a, b: a - b, "({0} - {1})"),
    "mul": Op(2, lambda a, b: a * b, "({0} * {1})"),
    "div": Op(2, lambda a, b: a / b, "({0} / {1})"),
    "neg": Op(1, lambda a: -a, "(-{0})"),
    "min": Op(2, _minimum, "({0} <= {1} ? {0} : {1})"),
    "max": Op(2, _maximum, "({0} >= {1} ? {0} : {1})"),
    "ceil_div": Op(2, _ceil_div, "(-floor(-{0} / {1}))"),
    "eq": Op(2, lambda a, b: 1.0 if a == b else 0.0, "({0} == {1} ? 1.0 : 0.0)"),
    "gt": Op(2, lambda a, b: 1.0 if a > b else 0.0, "({0} > {1} ? 1.0 : 0.0)"),
    "select": Op(3, lambda c, a, b: a if c != 0.0 else b, "({0} != 0.0 ? {1} : {2})"),
}


@dataclass(eq=False)
class Expr:
    """A node of the graph: an input (problem field), a kernel column, a constant, or an
    operation of OPS over other nodes. Nodes are compared by identity: a node used twice is
    computed once."""
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


def apply(op: str, *args) -> Expr:
    """The node applying OPS[op] to `args` (numbers become constants)."""
    if op not in OPS or OPS[op].arity != len(args):
        raise ValueError(f"unknown operation {op!r} with {len(args)} operand(s); "
                         f"valid: {', '.join(OPS)}")
    return Expr(op, tuple(lift(a) for a in args))


@dataclass(frozen=True)
class Statement:
    """`target = op(operands)`; an operand is ("input", name), ("kernel", column of the
    kernel table), ("const", value) or ("temp", number of an earlier statement)."""
    target: int
    level: str
    op: str
    operands: tuple[tuple[str, object], ...]


@dataclass
class CompiledProgram:
    """The statements the requested outputs need, in order, with the kernel table the
    problem-dependent ones read."""
    statements: list[Statement] = field(default_factory=list)
    kernel_table: list[list[float]] = field(default_factory=list)   # [kernel][column]
    outputs: dict[str, tuple[str, object]] = field(default_factory=dict)  # name -> operand
    levels: dict[str, str] = field(default_factory=dict)          # name -> level
    kernel_values: dict[str, list[float]] = field(default_factory=dict)  # const/kernel outputs


def compile_program(outputs: Mapping[str, Expr], kernels: Sequence[Mapping[str, float]]
                    ) -> CompiledProgram:
    """Sort the graphs of `outputs` into levels (see the module docstring). `kernels[i]`
    maps each kernel column name to kernel i's value. Constant nodes are folded and kernel
    nodes evaluated per kernel here: an output of either level comes back as one value per
    kernel in `kernel_values`, the others as an operand of the statements."""
    program = CompiledProgram()
    level: dict[int, str] = {}
    values: dict[int, list[float]] = {}      # const / kernel nodes: one value per kernel
    operand: dict[int, tuple[str, object]] = {}
    table: dict[int, list[float]] = {}       # kernel nodes a statement reads, in order

    def as_operand(node: Expr) -> tuple[str, object]:
        key = id(node)
        if key in operand:
            return operand[key]
        if level[key] == "const":
            return ("const", values[key][0])
        table.setdefault(key, values[key])
        return ("kernel", list(table).index(key))

    def visit(node: Expr) -> str:
        key = id(node)
        if key in level:
            return level[key]
        if node.op == "input":
            found = "problem"
            operand[key] = ("input", node.name)
        elif node.op == "const":
            found = "const"
            values[key] = [node.value] * len(kernels)
        elif node.op == "kernel":
            found = "kernel"
            try:
                values[key] = [float(kernel[node.name]) for kernel in kernels]
            except KeyError:
                raise ValueError(f"no kernel column {node.name!r}") from None
        else:
            found = max((visit(arg) for arg in node.args), key=LEVELS.index)
            if found == "problem" and any(level[id(arg)] == "kernel" for arg in node.args):
                found = "mixed"
            if found in ("const", "kernel"):
                evaluate = OPS[node.op].evaluate
                values[key] = [evaluate(*row)
                               for row in zip(*(values[id(arg)] for arg in node.args))]
            else:
                target = len(program.statements)
                program.statements.append(Statement(
                    target, found, node.op, tuple(as_operand(arg) for arg in node.args)))
                operand[key] = ("temp", target)
        level[key] = found
        return found

    for name, node in outputs.items():
        program.levels[name] = visit(node)
        if program.levels[name] in ("const", "kernel"):
            program.kernel_values[name] = list(values[id(node)])
        else:
            program.outputs[name] = operand[id(node)]
    columns = list(table.values())
    program.kernel_table = [[column[i] for column in columns] for i in range(len(kernels))]
    return program

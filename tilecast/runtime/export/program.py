"""A family's feature formulas (tilecast.features.formula graphs, the engine's own) as
statements of the exported selector. IEEE float64 evaluation in the graph's order gives the
same bits in the numpy engine, in the exported C and in any runtime that reads the JSON
form. `compile_program` sorts the graph into levels:

    const    no problem field, no kernel column (hardware features are constants): folded here
    kernel   kernel columns only: evaluated here once per kernel, stored in a table
    problem  problem fields only: computed once per query
    mixed    both: computed per candidate

and keeps only the statements the model's features need.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from tilecast.features.formula import OPS, Expr

LEVELS = ("const", "kernel", "problem", "mixed")


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


def compile_program(outputs: Mapping[str, Expr], kernels: Sequence[Mapping[str, float]],
                    hardware: Mapping[str, float] | None = None) -> CompiledProgram:
    """Sort the graphs of `outputs` into levels (see the module docstring). `kernels[i]`
    maps each kernel column name to kernel i's value, `hardware` each hardware feature to
    the constant baked in. Constant nodes are folded and kernel
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
        elif node.op == "hardware":
            found = "const"
            try:
                values[key] = [float((hardware or {})[node.name])] * len(kernels)
            except KeyError:
                raise ValueError(f"no hardware feature {node.name!r}") from None
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

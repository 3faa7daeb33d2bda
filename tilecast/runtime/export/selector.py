"""What an exported selector holds, built from a loaded Dispatcher; its JSON form.

The kernel table is the model's candidates in name order (the dispatcher's order among equal
predictions), then the static best when it is no candidate. The selector, like
Dispatcher.select:

1. refuses a problem the family refuses (INVALID_PROBLEM), and one beyond the range where
   the formulas' float64 arithmetic is exact (OUT_OF_RANGE; a family's exporter says which:
   GEMM has none beyond what the family refuses);
2. scores the candidates that apply to the problem (those of its applicability key, a code
   computed from the problem by the family exporter's graph; each code's candidates found at
   export by asking the family about a problem of that key): problem features once, mixed
   ones per candidate, the forest's raw score (inverse target transforms are increasing, so
   the order of raw scores is the order of predicted TFLOP/s; a raw score above
   `raw_score_max` is a TFLOP/s the dispatcher finds not finite, and is passed over);
3. returns the highest, the first in name order among equals (the first candidate when
   none is finite); with no candidate that applies, the static best when it applies, else
   NO_KERNEL (the dispatcher's NoKernelError).

A selector exported with a shortlist (Dispatcher(shortlist=K), tilecast.runtime.shortlist)
walks its tree on the problem features first and scores only the candidates of the leaf
that apply (all applicable ones when none does); one such candidate is the choice unscored.

The hardware features are constants: the values of the training machine's profile that
feature_spec.json records, which is what the dispatcher computes them from on any machine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from tilecast.features.hardware import HARDWARE_FEATURES
from tilecast.runtime.export import forest as forests
from tilecast.runtime.export.program import Statement, compile_program

FORMAT = "tilecast-selector"
FORMAT_VERSION = 3
INVALID_PROBLEM = -1
NO_KERNEL = -2
OUT_OF_RANGE = -3
SLOT_LEVELS = ("problem", "kernel", "mixed")
KEY = "__applicability_key__"   # the program's output holding the applicability key


class ExportError(ValueError):
    """A model version that cannot be exported, and why."""


@dataclass
class Selector:
    """Everything the exported code holds; see the module docstring."""
    model: str
    version: int
    family: str
    engine: dict
    target_transform: str
    hardware: dict                # feature -> the constant baked in
    inputs: list[dict]            # {"name", "ctype", "codes"}: the selector's arguments
    limits: dict
    # {"source": operand of the key, "candidates": [candidates per code],
    #  "static_best": [whether the static best applies, per code]}
    applicability: dict
    kernels: list[str]            # the kernel table
    candidates: int               # kernels[:candidates] are the model's candidates
    static_best: int
    statements: list[Statement]
    kernel_table: list[list[float]]   # per kernel: the kernel values statements read
    slots: list[dict]             # {"feature", "level", "source", "log2"}, problem first
    kernel_slot_values: list[list[float]] = field(default_factory=list)  # per kernel
    forest: forests.Forest = field(default_factory=forests.Forest)
    raw_score_max: float = math.inf
    # a shortlist: its tree over problem slots (leaf j: shortlist_rows[j]), or None
    shortlist: forests.Forest | None = None
    shortlist_rows: list[list[int]] = field(default_factory=list)   # candidates per leaf

    def slot_zero(self, slot: int) -> float:
        """What reads as zero in slot `slot` (forest.goes_left)."""
        return 1.0 if self.slots[slot]["log2"] else 0.0

    def level_slots(self, level: str) -> list[int]:
        return [i for i, slot in enumerate(self.slots) if slot["level"] == level]

    def to_json(self) -> dict:
        """The JSON form: every table of the C form, and the statements as data. To select:
        check the problem against `limits` (the family's: tilecast.runtime.export.<family>)
        and the `inputs`' codes; run the problem-level `statements`; the candidates are
        `applicability`'s "candidates" entry of the code its "source" operand holds (none:
        the static best when its "static_best" entry is true, else no kernel). Per
        candidate, run `statements` ([target, level, op,
        operands], op from tilecast.features.formula.OPS; an operand is ["input",
        name], ["const", value], ["kernel", column of that kernel's `kernel_table` row] or
        ["temp", target]); slot s reads its `source` operand (a "kernel" slot: the kernel's
        `kernel_slot_values` entry), a raw one read as 0 when |x| <= 1e-35. Walk each tree of
        `forest` from its root (a child < 0 is leaf -1 - child) with forest.goes_left (zero
        is 1.0 for a log2 slot) and sum the leaves in tree order; pick as the module
        docstring says. With a `shortlist` (else null): walk its tree the same way on the
        problem slots; when some candidate of its leaf's `rows` applies, only those are
        candidates, and one of them is the choice without scoring."""
        shortlist = None if self.shortlist is None else {
            "tree": self.shortlist.to_json(), "rows": self.shortlist_rows}
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "model": self.model, "version": self.version, "family": self.family,
            "engine": self.engine, "target_transform": self.target_transform,
            "hardware": self.hardware, "inputs": self.inputs, "limits": self.limits,
            "applicability": self.applicability,
            "fallback": {"invalid_problem": INVALID_PROBLEM, "no_kernel": NO_KERNEL,
                         "out_of_range": OUT_OF_RANGE},
            "kernels": self.kernels, "candidates": self.candidates,
            "static_best": self.static_best,
            "statements": [[s.target, s.level, s.op, [list(ref) for ref in s.operands]]
                           for s in self.statements],
            "kernel_table": self.kernel_table, "slots": self.slots,
            "kernel_slot_values": self.kernel_slot_values,
            "forest": self.forest.to_json(), "raw_score_max": self.raw_score_max,
            "shortlist": shortlist,
        }

    @classmethod
    def from_json(cls, document: Mapping) -> "Selector":
        """The selector of a JSON form (to_json); ExportError for another format."""
        if document.get("format") != FORMAT or document.get("format_version") != FORMAT_VERSION:
            raise ExportError(f"not a {FORMAT} version {FORMAT_VERSION} document (format "
                              f"{document.get('format')!r} version "
                              f"{document.get('format_version')!r})")
        statements = [Statement(target, level, op, tuple(tuple(ref) for ref in operands))
                      for target, level, op, operands in document["statements"]]
        names = ("model", "version", "family", "engine", "target_transform", "hardware",
                 "inputs", "limits", "applicability", "kernels", "candidates",
                 "static_best", "kernel_table", "slots",
                 "kernel_slot_values", "raw_score_max")
        shortlist = document.get("shortlist")
        return cls(statements=statements, forest=forests.Forest.from_json(document["forest"]),
                   shortlist=None if shortlist is None else
                   forests.Forest.from_json(shortlist["tree"]),
                   shortlist_rows=[] if shortlist is None else
                   [list(row) for row in shortlist["rows"]],
                   **{name: document[name] for name in names})


def build(dispatcher, exporter) -> Selector:
    """The Selector of a loaded Dispatcher, with `exporter` the family's module
    (tilecast.runtime.export.gemm, .grouped_conv). ExportError when the engine is not the one
    the exporter follows or the forest holds what the selector cannot reproduce."""
    from tilecast.runtime.dispatch import INVERSE_TRANSFORMS

    engine, family = dispatcher.engine, dispatcher.family
    label = f"version {dispatcher.version} of model {dispatcher.model!r}"
    _check_exporter(engine, exporter, label)
    candidates = sorted(dispatcher.kernels)
    kernels = candidates + ([] if dispatcher.static_best in candidates
                            else [dispatcher.static_best])
    configs = [family.parse_name(kernel) for kernel in kernels]
    kernel_rows = [dict(zip(exporter.KERNEL_FEATURES, row))   # kernel_features' columns
                   for row in engine.kernel_features(configs).tolist()]

    dump = dispatcher.booster.dump_model()
    model_features = list(dispatcher.feature_spec["feature_names"])
    used = forests.split_features(dump)
    short = None
    if dispatcher.shortlist is not None:
        short = dispatcher.shortlist.lightgbm_tree(
            {name: i for i, name in enumerate(model_features)})
        used |= forests.split_features(short)
    key, representatives = exporter.applicability(family)
    bindings, slots, kernel_values, program = _bind_features(
        model_features, used, exporter.features(family), exporter, engine.hw, kernel_rows,
        label, key)
    try:
        forest = forests.convert(dump, bindings)
        short_forest = None if short is None else \
            forests.convert_trees(short["tree_info"], bindings)
    except forests.ForestError as err:
        raise ExportError(f"{label}: {err}") from None
    # number the slots the pruned forest (and the shortlist) still read: problem, kernel, mixed
    read = sorted(set(forest.slot) | set(short_forest.slot if short_forest else ()),
                  key=lambda f: (SLOT_LEVELS.index(slots[f]["level"]), f))
    number = {f: i for i, f in enumerate(read)}
    forest.slot = [number[f] for f in forest.slot]
    shortlist_rows = []
    if short_forest is not None:
        off_problem = sorted({slots[f]["feature"] for f in short_forest.slot
                              if slots[f]["level"] != "problem"})
        if off_problem:
            raise ExportError(f"{label}: its shortlist splits on {off_problem}, which the "
                              "exporter does not compute from the problem alone")
        short_forest.slot = [number[f] for f in short_forest.slot]
        leaves = dispatcher.shortlist.leaves
        # a converted leaf's value is the shortlist's leaf number
        shortlist_rows = [sorted(candidates.index(k) for k in leaves[int(leaf)])
                          for leaf in short_forest.leaves]
    kernel_slots = [f for f in read if slots[f]["level"] == "kernel"]

    transform = dispatcher.feature_spec["target_transform"]
    applicability = _applicability(family, configs, len(candidates),
                                   configs[kernels.index(dispatcher.static_best)], representatives,
                                   program.outputs.get(KEY, program.kernel_values.get(KEY)))
    return Selector(
        model=dispatcher.model, version=dispatcher.version, family=family.name,
        engine={"name": engine.name, "version": engine.version}, target_transform=transform,
        hardware={name: float(engine.hw[name]) for name in HARDWARE_FEATURES},
        inputs=[{"name": n, "ctype": ctype, "codes": codes}
                for n, ctype, codes in exporter.INPUTS],
        limits=dict(exporter.LIMITS), applicability=applicability,
        kernels=kernels, candidates=len(candidates),
        static_best=kernels.index(dispatcher.static_best),
        statements=_needed(program.statements, [slots[f]["source"] for f in read
                                                if slots[f]["source"] is not None]
                           + [applicability["source"]]),
        kernel_table=program.kernel_table,
        slots=[slots[f] for f in read],
        kernel_slot_values=[[kernel_values[f][i] for f in kernel_slots]
                            for i in range(len(kernels))],
        forest=forest,
        raw_score_max=forests.raw_score_bound(INVERSE_TRANSFORMS[transform]),
        shortlist=short_forest, shortlist_rows=shortlist_rows)


def _check_exporter(engine, exporter, label: str) -> None:
    name, version, feature_names = exporter.WRITTEN_FOR
    if (engine.name, engine.version, tuple(engine.feature_names())) != \
            (name, version, feature_names):
        raise ExportError(f"{label}: the installed {engine.name!r} engine (version "
                          f"{engine.version}) is not the {name!r} version {version} the "
                          f"exporter's formulas follow; update tilecast.runtime.export."
                          f"{exporter.__name__.rsplit('.', 1)[-1]}")


def _bind_features(model_features: list[str], used: set[int], formulas: dict, exporter,
                   hardware, kernel_rows: list[dict], label: str, key):
    """(bindings, slots, kernel values, compiled program) of the model features the splits
    read (slots and kernel values keyed by model feature): a hardware feature is a
    constant; a kernel feature (or a formula of kernel values only) a kernel slot with one
    value per kernel, baked here; a formula over the problem a problem or mixed slot whose
    source is an operand of the program's statements. The program also computes the
    applicability key `key` (output KEY)."""
    outputs = {model_features[f]: formulas[model_features[f]].graph
               for f in sorted(used) if model_features[f] in formulas}
    program = compile_program({**outputs, KEY: key}, kernel_rows, hardware)
    bindings: list[forests.Binding | None] = [None] * len(model_features)
    slots: dict[int, dict] = {}
    kernel_values: dict[int, list[float]] = {}
    for f in sorted(used):
        feature = model_features[f]
        if feature in HARDWARE_FEATURES:
            bindings[f] = forests.Binding(constant=float(hardware[feature]))
            continue
        if feature in formulas:
            log2, level = formulas[feature].log2, program.levels[feature]
        elif feature in exporter.KERNEL_FEATURES:
            log2, level = False, "kernel"
        else:
            raise ExportError(f"{label}: feature {feature!r} has no formula in "
                              f"{exporter.__name__}")
        if level in ("const", "kernel"):
            values = (program.kernel_values[feature] if feature in formulas else
                      [row[feature] for row in kernel_rows])
            if log2:   # numpy's log2, as the engine takes it
                values = np.log2(np.asarray(values, dtype=np.float64)).tolist()
            values = [forests.lightgbm_read(v) for v in values]
            if level == "const":
                bindings[f] = forests.Binding(constant=values[0])
                continue
            kernel_values[f] = values
            slots[f] = {"feature": feature, "level": "kernel", "source": None, "log2": False}
        else:
            slots[f] = {"feature": feature, "level": level,
                        "source": list(program.outputs[feature]), "log2": log2}
        bindings[f] = forests.Binding(slot=f, log2=slots[f]["log2"])
    return bindings, slots, kernel_values, program


def _applicability(family, configs: list, candidates: int, static_config, representatives: list,
                   source) -> dict:
    """The selector's applicability: per key code, the candidates family.applicable admits
    for a problem of that key and whether the static best does. The
    codes must be 0..n-1 (the C indexes its table by code) and the key a problem-level
    operand (or one constant)."""
    codes = [code for code, _ in representatives]
    if sorted(codes) != list(range(len(codes))):
        raise ExportError(f"{family.name} applicability codes {codes} are not "
                          f"0..{len(codes) - 1}: the selector indexes its candidate sets by code")
    if isinstance(source, list):   # a constant key: one value per kernel, all equal
        source = ("const", float(source[0]))
    rows: list[list[int]] = [[] for _ in codes]
    static: list[bool] = [False for _ in codes]
    for code, problem in representatives:
        if problem is None:
            continue
        rows[code] = [c for c in range(candidates) if family.applicable(configs[c], problem)]
        static[code] = bool(family.applicable(static_config, problem))
    return {"source": list(source), "candidates": rows, "static_best": static}


def _needed(statements: list[Statement], sources: list) -> list[Statement]:
    """The statements the sources need (a split on a hardware feature can prune every node
    that read a slot, leaving its statements unused)."""
    wanted = {what for kind, what in sources if kind == "temp"}
    kept = []
    for statement in reversed(statements):
        if statement.target in wanted:
            kept.append(statement)
            wanted |= {what for kind, what in statement.operands if kind == "temp"}
    return kept[::-1]

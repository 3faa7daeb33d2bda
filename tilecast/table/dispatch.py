"""Run-time dispatch for a table model: the configuration to run for a problem on a device.

`Dispatcher.from_registry` / `from_directory` return a TableDispatcher for a model whose
feature_spec.json says `"family": "table"`. A query names the device (a name or any label of
the model's stored device entries, or of the shipped table with the user's additions, for a
device the model never saw: its prediction then comes from the device's features alone).
Configurations that failed or were invalid on that device in the training data are never
chosen there. Each answer carries a confidence from the model's calibration (calibration.json,
fitted on held-out predictions when the model was trained: leave-one-device-out for a device
the model never saw measured, problem folds for a new problem on a training device); below its
threshold the answer is "unsure" and comes with the shortlist worth measuring. Where the top
prediction does not beat the model's incumbent (its training data's best-on-average
configuration) by the calibration's margin, the answer is the incumbent (Choice.incumbent),
except for a problem measured on that device in the training data; with no calibration for
the case (a device the model never saw, trained on one device) the answer is the incumbent,
unsure.
Rankings are memoized per (device, problem), so a repeated query costs a dictionary lookup.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from tilecast.core import kinds
from tilecast.core.artifact import CALIBRATION_FILE, ModelArtifactError
from tilecast.registry import api as registry, integrity
from tilecast.registry.api import RegistryError
from tilecast.runtime.query import (DEFAULT_CACHE_SIZE, ProblemError, parse_problem_string,
                                    raw_key)
from tilecast.table.confidence import NEVER, Calibrations, guarded, incumbent_gain
from tilecast.table.dataset import TableDataError
from tilecast.table.model import FAMILY, TableModel, check_problem, resolve_device

#: configurations an unsure answer offers to measure (the issue's figure: 20 reach >= 0.97)
DEFAULT_SHORTLIST = 20


@dataclass(frozen=True)
class Choice:
    """One answer: the configuration, how sure the model is, and what to measure when unsure.
    `confidence` is the calibrated P(the pick reaches `target` of the best) (0.0 when the
    model has no calibration for the case); `shortlist` is empty when sure. `beyond`: the
    hardware figures on which the device lies further out than the calibration measured
    (TableModel.beyond); any makes the answer unsure whatever its confidence. `incumbent`:
    the answer is the model's incumbent in place of a different top prediction, which did not
    beat it by the calibration's margin (tilecast.table.confidence)."""
    kernel: str
    confidence: float
    unsure: bool
    shortlist: tuple[str, ...]
    device: str
    predicted_efficiency: float
    beyond: tuple[str, ...] = ()
    incumbent: bool = False


class TableRanking:
    """A problem's allowed candidates on one device, best predicted first, except that the
    model's incumbent comes first when the top prediction does not beat it by the
    calibration's margin (`guarded`; tilecast.table.confidence, the incumbent guard)."""
    __slots__ = ("device", "kernels", "efficiencies", "confidence", "threshold", "beyond",
                 "guarded")

    def __init__(self, device: str, kernels, scores: np.ndarray, calibration,
                 beyond: Sequence[str] = (), incumbent: str | None = None):
        self.device = device
        self.beyond = tuple(beyond)
        order = np.argsort(-scores, kind="stable")   # equal predictions in key order
        # no calibration for the case (a new device of a model trained on one): no evidence
        # that a pick beats the incumbent, so the incumbent it is (unsure, with the shortlist)
        margin = NEVER if calibration is None else calibration.margin
        gain = incumbent_gain(scores, kernels, incumbent)
        self.guarded = False          # the guard put the incumbent before a different top
        if guarded(np.array([gain]), margin)[0]:
            first = list(kernels).index(incumbent)
            self.guarded = bool(order[0] != first)
            order = np.concatenate(([first], order[order != first]))
        self.kernels = tuple(np.asarray(kernels, dtype=object)[order].tolist())
        self.efficiencies = tuple(scores[order].tolist())
        self.confidence = 0.0 if calibration is None else float(calibration.confidence(scores))
        self.threshold = np.inf if calibration is None else calibration.threshold

    @property
    def best(self) -> str:
        return self.kernels[0]


class TableDispatcher:
    """Picks a configuration per (problem, device) from one table model.

    Attributes: `model` (registry model name), `version`, `family` ("table"), `table_model`
    (the TableModel), `calibrations` (confidence.Calibrations: per case, or None), `kernels`
    (the candidates). `calibration` may be one Calibration for both cases."""
    family = FAMILY
    kind = kinds.KINDS["table"]

    def __init__(self, table_model: TableModel, calibration=None, *, model: str = "",
                 version: int | None = None, cache_size: int = DEFAULT_CACHE_SIZE,
                 shortlist_size: int = DEFAULT_SHORTLIST):
        self.table_model = table_model
        self.calibrations = Calibrations.of(calibration)
        self.model = model
        self.version = version
        self.kernels = tuple(table_model.candidates())
        self.shortlist_size = int(shortlist_size)
        self._cache: dict[Any, TableRanking] = {}
        self._cache_size = int(cache_size)
        self._devices: dict[str, tuple[str, Any]] = {}

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_directory(cls, path, *, model: str = "", version: int | None = None,
                       **options) -> "TableDispatcher":
        """Load a table model directory (checked against its checksums.json when it has one)."""
        path = Path(path)
        integrity.verify_directory(path)
        return cls.load(path, model=model, version=version, **options)

    @classmethod
    def from_registry(cls, root, model: str, alias: str | int = "production", *,
                      cache_dir=None, **options) -> "TableDispatcher":
        """The dispatcher of version `alias` of `model` (a table model) in the registry at
        `root`; RegistryError when it is another family's model."""
        version = registry.resolve_version(root, model, alias)
        path = registry.local_copy(root, model, version, cache_dir=cache_dir)
        return cls.load(path, model=model, version=version, **options)

    @classmethod
    def load(cls, path, *, model: str = "", version: int | None = None,
             **options) -> "TableDispatcher":
        """Load a verified directory: the TableModel and calibration.json. RegistryError
        naming a missing or damaged file."""

        path = Path(path)
        try:
            table_model = TableModel.load(path)
        except ModelArtifactError as err:
            raise RegistryError(str(err)) from None
        calibration_path = path / CALIBRATION_FILE
        try:
            calibration = Calibrations.from_json(json.loads(calibration_path.read_text()))
        except FileNotFoundError:
            raise RegistryError(f"table model {path} has no {CALIBRATION_FILE}; train it again "
                                "with `tilecast train --dataset`") from None
        except (OSError, ValueError) as err:
            raise RegistryError(f"{calibration_path} is damaged: {err}") from None
        return cls(table_model, calibration, model=model, version=version, **options)

    # -- problems and devices -----------------------------------------------------------

    def problem(self, problem) -> dict[str, Any]:
        """The checked problem values from a mapping or a 'name=value,...' string;
        ProblemError naming the column that is missing, unknown or unreadable."""
        if isinstance(problem, str):
            problem = parse_problem_string(problem)
        elif not isinstance(problem, Mapping):
            raise TypeError(f"problem must be a mapping or a 'name=value,...' string, got "
                            f"{type(problem).__name__}")
        try:
            return check_problem(self.table_model.schema, problem)
        except TableDataError as err:
            raise ProblemError(str(err)) from None

    def device(self, device: str | None) -> tuple[str, Any]:
        """(canonical name, device table holding it) of a device label. None names the one
        training device of a model trained on one; UnknownDeviceError (saying how to add
        the device) for a label neither the model nor the device tables know."""
        if device is None:
            trained = self.table_model.training_devices
            if len(trained) != 1:
                raise ProblemError(f"table model {self.model!r} was trained on "
                                   f"{len(trained)} devices ({', '.join(trained)}); name the "
                                   "device to choose for (device=..., --device)")
            device = trained[0]
        found = self._devices.get(device)
        if found is None:
            found = resolve_device(self.table_model.devices, device)
            self._devices[device] = found
        return found

    # -- queries --------------------------------------------------------------------------

    def offered(self, candidates) -> tuple[str, ...]:
        """The canonical keys of the configurations a caller offers: keys ('name=value,...'),
        mappings of the configuration columns, or, for a one-column configuration, its bare
        values. ProblemError, in one line, for one the model never saw ok in its training
        data: it cannot be ranked."""
        from tilecast.table.dataset import key_of, parse_key

        columns = self.table_model.schema.config
        names = [c.name for c in columns]
        known = set(self.kernels)
        keys = []
        for candidate in candidates:
            try:
                if isinstance(candidate, Mapping):
                    key = key_of(names, _config_values(columns, candidate))
                elif len(names) == 1 and not str(candidate).startswith(f"{names[0]}="):
                    key = key_of(names, _config_values(columns, {names[0]: candidate}))
                else:
                    key = key_of(names, parse_key(str(candidate), columns))
            except (ValueError, KeyError, TableDataError) as err:
                raise ProblemError(f"candidate {candidate!r}: {err}; give "
                                   f"{', '.join(names)} as 'name=value,...'") from None
            if key not in known:
                raise ProblemError(
                    f"candidate {key!r} was never measured ok in the training data of "
                    f"{self.model or 'this model'}: it cannot be ranked; import measurements "
                    f"of it and train again, or leave it out (known: {len(known)}, e.g. "
                    f"{sorted(known)[0]!r})")
            keys.append(key)
        if not keys:
            raise ProblemError("candidates: an empty list; offer at least one configuration")
        return tuple(sorted(set(keys)))

    def ranking(self, problem, device: str | None = None,
                candidates: Sequence | None = None) -> TableRanking:
        """The memoized ranking of the allowed candidates for `problem` on `device`, or of
        the allowed ones among `candidates`, the configurations the caller offers (an
        autotuner offers each problem its own; see `offered`)."""
        offered = None if candidates is None else self.offered(candidates)
        raw = raw_key(problem)
        key = (device, raw, offered)
        found = self._cache.get(key) if raw is not None else None
        if found is not None:
            return found
        values = self.problem(problem)
        name, table = self.device(device)
        checked = (name, tuple(values.items()), offered)
        found = self._cache.get(checked)
        if found is None:
            kernels = self.table_model.allowed(name)
            if offered is not None:
                kernels = [k for k in kernels if k in set(offered)]
            if not kernels:
                raise ProblemError(
                    f"every candidate {'offered ' if offered else ''}of table model "
                    f"{self.model!r} failed on {name} in its training data: nothing to "
                    "choose there")
            scores = self.table_model.scores(values, name, kernels, table)
            trained = name in self.table_model.training_devices
            calibration = self.calibrations.for_device(trained)
            incumbent = self.table_model.incumbent
            # a measured pair is no new problem: the guard calibrated on new ones stays out
            # (asked only where a guard could act: it searches the measured problems)
            if (incumbent is not None and trained and calibration is not None
                    and calibration.margin > 0 and self.table_model.measured(values, name)):
                incumbent = None
            found = TableRanking(name, kernels, scores, calibration,
                                 self.table_model.beyond(name, table), incumbent)
            self._remember(checked, found)
        if raw is not None:
            self._remember(key, found)
        return found

    def _remember(self, key, ranking: TableRanking) -> None:
        if len(self._cache) >= self._cache_size:
            self._cache.pop(next(iter(self._cache)))   # oldest entry first
        self._cache[key] = ranking

    def select(self, problem, device: str | None = None, candidates: Sequence | None = None) -> str:
        """The configuration predicted fastest for `problem` on `device` (among
        `candidates`, when the caller offers them)."""
        return self.ranking(problem, device, candidates).best

    def rank(self, problem, k: int = 5, device: str | None = None,
             candidates: Sequence | None = None) -> list[tuple[str, float]]:
        """The k best (configuration, predicted efficiency) pairs in the ranking's order
        (best predicted first; the incumbent first when the guard answers it)."""
        if k < 1:
            raise ValueError(f"k={k} must be >= 1")
        ranking = self.ranking(problem, device, candidates)
        return list(zip(ranking.kernels[:k], ranking.efficiencies[:k]))

    def predict(self, problem, device: str | None = None,
                candidates: Sequence | None = None) -> dict[str, float]:
        """Predicted efficiency of every allowed candidate, in the ranking's order."""
        ranking = self.ranking(problem, device, candidates)
        return dict(zip(ranking.kernels, ranking.efficiencies))

    def shortlist(self, problem, k: int, device: str | None = None,
                  candidates: Sequence | None = None) -> list[str]:
        """The k configurations worth measuring (fewer when fewer are allowed): the k highest
        predictions in the ranking's order (the incumbent first when the guard answers it),
        never one that failed on the device."""
        if k < 1:
            raise ValueError(f"k={k} must be >= 1")
        return list(self.ranking(problem, device, candidates).kernels[:k])

    def choice(self, problem, device: str | None = None,
               candidates: Sequence | None = None) -> Choice:
        """The pick with its confidence; unsure (with the shortlist to measure) below the
        calibration's threshold, always when the model has no calibration for the case or the
        device lies further out than it measured (Choice.beyond)."""
        ranking = self.ranking(problem, device, candidates)
        unsure = not ranking.confidence >= ranking.threshold or bool(ranking.beyond)
        return Choice(kernel=ranking.best, confidence=ranking.confidence, unsure=unsure,
                      shortlist=ranking.kernels[:self.shortlist_size] if unsure else (),
                      device=ranking.device, predicted_efficiency=ranking.efficiencies[0],
                      beyond=ranking.beyond, incumbent=ranking.guarded)

    def select_json(self, problem, device: str | None = None,
                    candidates: Sequence | None = None) -> dict:
        """{"kernel", "predicted_efficiency", "confidence", "unsure", "shortlist", "device",
        "beyond", "incumbent", "model", "version"} for `tilecast select --json`."""
        choice = self.choice(problem, device, candidates)
        return {"kernel": choice.kernel, "predicted_efficiency": choice.predicted_efficiency,
                "confidence": choice.confidence, "unsure": choice.unsure,
                "shortlist": list(choice.shortlist), "device": choice.device,
                "beyond": list(choice.beyond), "incumbent": choice.incumbent,
                "model": self.model, "version": self.version}


def _config_values(columns, values: Mapping) -> dict[str, Any]:
    """A configuration's values by column kind (numbers for numeric columns); KeyError for a
    missing column, ValueError for an unknown one or a numeric column given a word."""
    unknown = sorted(set(values) - {c.name for c in columns})
    if unknown:
        raise ValueError(f"unknown configuration column(s) {unknown}")
    return {c.name: float(values[c.name]) if c.kind == "numeric" else str(values[c.name])
            for c in columns}

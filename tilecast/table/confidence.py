"""How sure a table model's pick is: a problem's predicted scores -> P(the pick reaches target).

The dispatcher answers "unsure" (measure a shortlist instead) when a pick's confidence is below
a threshold. Confidence comes from one number per problem, the pick's slack in log-efficiency
units: how far the top prediction stands above the runner-up plus how high it is itself,

    slack = log(p1 / p2) + log(p1)          p1 >= p2 the two highest predicted efficiencies

(a narrow margin means the ranking could flip on a small error; a low top prediction means the
model sees no configuration it believes in). Held-out outcomes (did the pick reach `target` of
the best?) are fitted against the slack by isotonic regression, so confidence is monotone in
slack and reads as a probability on the calibration data. The threshold is then the lowest
confidence at which the confident-wrong share (sure answers below target, over ALL problems)
stays within `max_wrong`: the largest coverage the budget allows.

Held-out outcomes come in groups, one per held-out device: a new device is one more draw of a
device, not of a problem, so with `groups` the threshold must keep the budget on every group
alone (the worst device decides), and fewer than MIN_GROUPS groups calibrate nothing.

With fewer than MIN_PROBLEMS calibration problems (or MIN_GROUPS groups), or when no threshold
keeps within the budget, the calibration answers "unsure" for every problem (`threshold` =
inf, written as null in JSON) and says why in `note`: a threshold fitted to a handful of
outcomes would promise a confident-wrong rate nobody measured.

The incumbent guard. Where one configuration is near-best everywhere (a vendor library's
default), a model's pick that differs from it often wins a little and sometimes loses much.
A table model carries its incumbent, the configuration best on average over its training
devices (TableModel.incumbent), and a calibration carries `margin`: the dispatcher answers
the incumbent instead of the top prediction when the top prediction stands less than
`margin` (in predicted efficiency) above the incumbent's own. The margin is the one of
MARGINS under which the held-out picks, each guarded by its own inner model's incumbent,
reach the highest mean efficiency, or the largest margin whose mean lies within one standard
error (of its per-problem difference from that best) below it: the incumbent keeps what the
held-out picks cannot show the model beats, which on a handful of them (one problem on five
devices) is everything but a clear win; 0 keeps every top prediction, inf always answers the
incumbent. The confidence is then fitted to the guarded picks' outcomes, the answers the
dispatcher gives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

#: Fewer held-out problems than this and no threshold is fitted: at max_wrong = 0.02 even 50
#: problems allow only one confident-wrong pick, and 20 is where an isotonic fit stops being
#: a few steps drawn through single outcomes.
MIN_PROBLEMS = 20
#: Fewer held-out devices than this and no threshold is fitted: two devices say nothing of
#: how a third will go.
MIN_GROUPS = 3
#: Predictions at or below this are treated as this (log of a non-positive efficiency).
FLOOR = 1e-6
#: The margin of a problem with a single allowed candidate (nothing to confuse it with):
#: log(e), a runner-up predicted at 37 % of the pick.
SOLE_CANDIDATE_MARGIN = 1.0
NEVER = math.inf
#: The margins an incumbent guard chooses among (predicted-efficiency units; module docstring).
MARGINS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, NEVER)


def group_codes(groups: Sequence[str], count: int) -> np.ndarray:
    """Integer codes 0.. of `groups` (one label per problem); ValueError when the count is off."""
    if len(groups) != count:
        raise ValueError(f"{len(groups)} group labels for {count} problems; one each")
    return np.unique(np.asarray(list(map(str, groups))), return_inverse=True)[1]


def slack(predicted_scores: np.ndarray) -> float:
    """The pick's slack, log(p1 / p2) + log(p1), from one problem's predicted efficiencies
    over its allowed candidates (see the module docstring). ValueError when there are none or
    one is not finite."""
    scores = np.asarray(predicted_scores, dtype=np.float64).ravel()
    if scores.size == 0:
        raise ValueError("no predicted scores: a problem needs at least one allowed candidate")
    if not np.all(np.isfinite(scores)):
        raise ValueError(f"predicted scores {scores[~np.isfinite(scores)][:5]} are not finite")
    logs = np.log(np.maximum(scores, FLOOR))
    if logs.size == 1:
        return float(logs[0] + SOLE_CANDIDATE_MARGIN)
    second, first = np.partition(logs, logs.size - 2)[-2:]
    return float(2.0 * first - second)


@dataclass(frozen=True)
class Calibration:
    """Maps a problem's predicted scores to P(the pick reaches >= target of the best).

    `slacks` and `probabilities` are the isotonic fit's knots (confidence between them is
    interpolated, beyond them clipped); `threshold` is the confidence below which the
    dispatcher answers "unsure" (inf: always unsure, see `note`). `margin` is the incumbent
    guard's (module docstring; 0: none), `margin_note` what the held-out picks said of it."""
    slacks: tuple[float, ...]
    probabilities: tuple[float, ...]
    threshold: float
    target: float = 0.9
    max_wrong: float = 0.02
    n_problems: int = 0
    note: str = ""
    margin: float = 0.0
    margin_note: str = ""

    def __post_init__(self) -> None:
        if len(self.slacks) != len(self.probabilities) or not self.slacks:
            raise ValueError(f"calibration knots: {len(self.slacks)} slacks and "
                             f"{len(self.probabilities)} probabilities; need as many, >= 1")
        if any(b < a for a, b in zip(self.slacks, self.slacks[1:])) or \
                any(b < a for a, b in zip(self.probabilities, self.probabilities[1:])):
            raise ValueError("calibration knots must be non-decreasing in slack and probability")

    def confidence(self, predicted_scores: np.ndarray) -> float:
        """P(pick >= target of the best) for one problem's predicted scores over its allowed
        candidates."""
        return float(np.interp(slack(predicted_scores), self.slacks, self.probabilities))

    def sure(self, predicted_scores: np.ndarray) -> bool:
        """Whether the pick is confident enough to answer without measuring."""
        return self.confidence(predicted_scores) >= self.threshold

    def to_json(self) -> dict:
        return {"slacks": list(self.slacks), "probabilities": list(self.probabilities),
                "threshold": None if math.isinf(self.threshold) else self.threshold,
                "target": self.target, "max_wrong": self.max_wrong,
                "n_problems": self.n_problems, "note": self.note,
                "margin": None if math.isinf(self.margin) else self.margin,
                "margin_note": self.margin_note}

    @classmethod
    def from_json(cls, doc) -> "Calibration":
        try:
            threshold = NEVER if doc["threshold"] is None else float(doc["threshold"])
            margin = doc.get("margin", 0.0)      # a calibration before the guard: none
            margin = NEVER if margin is None else float(margin)
            if not margin >= 0.0:
                raise ValueError(f"margin {margin} must be >= 0")
            return cls(slacks=tuple(map(float, doc["slacks"])),
                       probabilities=tuple(map(float, doc["probabilities"])),
                       threshold=threshold, target=float(doc["target"]),
                       max_wrong=float(doc["max_wrong"]), n_problems=int(doc["n_problems"]),
                       note=str(doc.get("note", "")), margin=margin,
                       margin_note=str(doc.get("margin_note", "")))
        except (KeyError, TypeError) as err:
            raise ValueError(f"not a calibration document ({err!r}): {str(doc)[:200]}") from None


def _efficiencies(values: Sequence[float], what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(array)) or np.any((array < 0) | (array > 1 + 1e-9)):
        raise ValueError(f"efficiencies of the {what} must be finite and in [0, 1]")
    return array


def incumbent_gain(predicted_scores: np.ndarray, kernels: Sequence[str],
                   incumbent: str | None) -> float:
    """How far the top prediction stands above the incumbent's (>= 0); NaN when there is no
    incumbent or it is not among `kernels` (failed there: no guard)."""
    if incumbent is None or incumbent not in kernels:
        return math.nan
    scores = np.asarray(predicted_scores, dtype=np.float64)
    return float(scores.max() - scores[list(kernels).index(incumbent)])


def guarded(gains: np.ndarray, margin: float) -> np.ndarray:
    """Which problems the guard answers with the incumbent: gain below `margin` (a NaN gain,
    no incumbent there, never)."""
    gains = np.asarray(gains, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.isfinite(gains) & (gains < margin)


def fit_margin(gains: Sequence[float], efficiency_of_pick: Sequence[float],
               efficiency_of_incumbent: Sequence[float]) -> tuple[float, str]:
    """(margin, note): the incumbent guard's margin from held-out picks (module docstring):
    per problem the top prediction's gain over the incumbent (incumbent_gain), the measured
    efficiency of the pick and of the incumbent (0 where it failed or was not measured)."""
    gains = np.asarray(gains, dtype=np.float64)
    pick = _efficiencies(efficiency_of_pick, "picks")
    incumbent = np.nan_to_num(np.asarray(efficiency_of_incumbent, dtype=np.float64), nan=0.0)
    if not len(gains) == len(pick) == len(incumbent):
        raise ValueError(f"{len(gains)} gains, {len(pick)} pick and {len(incumbent)} incumbent "
                         "efficiencies; one each")
    scored = np.isfinite(gains)
    if not scored.any():
        return 0.0, "no held-out pick had the incumbent to choose: no guard"
    answers = np.array([np.where(guarded(gains, m), incumbent, pick)[scored] for m in MARGINS])
    means = answers.mean(axis=1)
    best = int(np.argmax(means))
    # one standard error of each margin's paired difference from the best one
    spread = (answers - answers[best]).std(axis=1, ddof=1) if answers.shape[1] > 1 else \
        np.full(len(MARGINS), np.inf)
    within = means >= means[best] - np.nan_to_num(spread, nan=np.inf) / math.sqrt(answers.shape[1])
    chosen = max(i for i in range(len(MARGINS)) if within[i])
    margin = MARGINS[chosen]
    share = float(guarded(gains, margin)[scored].mean())
    return margin, (f"margin {margin:g}: the incumbent on {share:.0%} of {int(scored.sum())} "
                    f"held-out picks, mean efficiency {means[chosen]:.3f} (model alone "
                    f"{means[0]:.3f}, incumbent alone {means[-1]:.3f})")


def fit_calibration(predicted: Sequence[np.ndarray], efficiency_of_pick: Sequence[float], *,
                    target: float = 0.9, max_wrong: float = 0.02,
                    groups: Sequence[str] | None = None,
                    gains: Sequence[float] | None = None,
                    efficiency_of_incumbent: Sequence[float] | None = None) -> Calibration:
    """The calibration of held-out outcomes: per problem, the predicted scores over its
    allowed candidates and the measured efficiency of the pick (0 for a pick that failed).
    With `gains` and `efficiency_of_incumbent` (fit_margin's), the incumbent guard's margin
    is fitted first and the confidence to the guarded picks' outcomes.

    The threshold is the lowest fitted confidence at which the picks answered sure fall below
    `target` on at most `max_wrong` of all problems, and of each group's problems when
    `groups` (one label per problem: its held-out device) are given (see the module docstring
    for when it is inf instead)."""
    if len(predicted) != len(efficiency_of_pick):
        raise ValueError(f"{len(predicted)} problems' scores but {len(efficiency_of_pick)} "
                         "efficiencies; one each")
    if not 0.0 < target <= 1.0 or not 0.0 <= max_wrong < 1.0:
        raise ValueError(f"target {target} must be in (0, 1] and max_wrong {max_wrong} in [0, 1)")
    efficiency = _efficiencies(efficiency_of_pick, "picks")
    margin, margin_note = 0.0, ""
    if gains is not None:
        if efficiency_of_incumbent is None:
            raise ValueError("gains without the incumbent's efficiencies")
        margin, margin_note = fit_margin(gains, efficiency, efficiency_of_incumbent)
        incumbent = np.nan_to_num(np.asarray(efficiency_of_incumbent, dtype=np.float64))
        efficiency = np.where(guarded(np.asarray(gains, dtype=np.float64), margin), incumbent,
                              efficiency)
    count = len(efficiency)
    settings = {"target": target, "max_wrong": max_wrong, "n_problems": count,
                "margin": margin, "margin_note": margin_note}
    if count < MIN_PROBLEMS:
        return Calibration(slacks=(0.0,), probabilities=(0.0,), threshold=NEVER, **settings,
                           note=f"too little calibration data: {count} held-out problems, "
                                f"need {MIN_PROBLEMS}; every pick answers unsure")
    labels = np.zeros(count, dtype=int) if groups is None else group_codes(groups, count)
    if groups is not None and labels.max() + 1 < MIN_GROUPS:
        return Calibration(slacks=(0.0,), probabilities=(0.0,), threshold=NEVER, **settings,
                           note=f"too little calibration data: {labels.max() + 1} held-out "
                                f"device(s), need {MIN_GROUPS}; every pick answers unsure")
    from sklearn.isotonic import IsotonicRegression   # at fit time: dispatchers never fit

    slacks = np.array([slack(scores) for scores in predicted])
    reached = (efficiency >= target).astype(np.float64)
    isotonic = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True,
                                  out_of_bounds="clip").fit(slacks, reached)
    knots = (tuple(map(float, isotonic.X_thresholds_)), tuple(map(float, isotonic.y_thresholds_)))
    confidence = np.interp(slacks, *knots)
    wrong = reached == 0.0
    threshold, covered = NEVER, 0.0
    sizes = np.bincount(labels)
    for level in np.unique(confidence):   # ascending: the first that fits covers the most
        sure = confidence >= level
        wrong_per_group = np.bincount(labels, weights=sure & wrong, minlength=len(sizes))
        if np.all(wrong_per_group <= max_wrong * sizes + 1e-9):
            threshold, covered = float(level), float(sure.mean())
            break
    note = (f"sure on {covered:.0%} of {count} calibration problems" if threshold != NEVER else
            f"no confidence level keeps confident-wrong picks within {max_wrong:.0%} of "
            f"{count} calibration problems; every pick answers unsure")
    return Calibration(slacks=knots[0], probabilities=knots[1], threshold=threshold,
                       **settings, note=note)


@dataclass(frozen=True)
class Calibrations:
    """A table model's two calibrations: `new_device` from leave-one-device-out picks (a
    device the model never saw measured), `known_device` from problem folds (a new problem
    on a training device). Either may be None: no split measured that case, every such pick
    answers unsure. calibration.json holds {"new_device": ..., "known_device": ...}; a file
    with one calibration (format 3 models) serves both cases, as it did."""
    new_device: Calibration | None
    known_device: Calibration | None

    def for_device(self, trained_on: bool) -> Calibration | None:
        return self.known_device if trained_on else self.new_device

    def to_json(self) -> dict:
        return {name: None if value is None else value.to_json()
                for name, value in (("new_device", self.new_device),
                                    ("known_device", self.known_device))}

    @classmethod
    def from_json(cls, doc) -> "Calibrations":
        if isinstance(doc, dict) and "slacks" in doc:         # one calibration for both
            single = Calibration.from_json(doc)
            return cls(new_device=single, known_device=single)
        if not isinstance(doc, dict) or not {"new_device", "known_device"} <= set(doc):
            raise ValueError("not a calibration document (need new_device and known_device): "
                             f"{str(doc)[:200]}")
        return cls(*(None if doc[name] is None else Calibration.from_json(doc[name])
                     for name in ("new_device", "known_device")))

    @classmethod
    def of(cls, calibration) -> "Calibrations":
        """`calibration` as Calibrations: a single Calibration (or None) serves both cases."""
        if isinstance(calibration, cls):
            return calibration
        return cls(new_device=calibration, known_device=calibration)

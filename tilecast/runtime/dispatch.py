"""Run-time dispatch: pick the kernel a published performance model predicts fastest.

Everything that does not depend on the problem (parsing the candidate names, their kernel
features, the feature-column map, the flattened forest) is done once when the Dispatcher is
built; a query validates the problem, builds one feature matrix, scores it once and memoizes
the ranking, so a repeated shape costs a dictionary lookup. Features and scores come from the
native fast paths (tilecast.runtime.native) where they are available, and equal the numpy engine's
and Booster.predict's there; elsewhere from those references.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from tilecast.families import get_family
from tilecast.core.family import FamilyError
from tilecast.registry import api as registry, integrity
from tilecast.registry.api import RegistryError
from tilecast.core import kinds
from tilecast.runtime import shortlist as shortlists
from tilecast.registry import prebuilt
from tilecast.runtime.query import (  # noqa: F401  (the dispatcher's names, as before)
    DEFAULT_CACHE_SIZE, MAX_FIELD_VALUE, PROBLEM_EXAMPLE, NoKernelError, ProblemError,
    parse_problem, parse_problem_string, raw_key)
from tilecast.runtime.native.scoring import CandidateScorer
from tilecast.core.artifact import CANDIDATES_FILE, FEATURE_SPEC_FILE, MODEL_FILE, TARGET_TRANSFORMS

if TYPE_CHECKING:
    import lightgbm

logger = logging.getLogger(__name__)

# feature_spec.json "target_transform" -> the inverse that turns predictions into TFLOP/s
INVERSE_TRANSFORMS = {name: inverse for name, (_, inverse) in TARGET_TRANSFORMS.items()}


class Ranking:
    """The applicable candidates for one problem, best first, with predicted TFLOP/s.
    On fallback, `kernels` is (static best,), `tflops` is (nan,) and `fallback_reason` says why.

    `best` is found when the ranking is made; the full order (`kernels`, `tflops`) is sorted
    on first use, so `select` never pays for sorting every candidate."""
    __slots__ = ("best", "fallback_reason", "_names", "_scores", "_sorted")

    def __init__(self, names, scores, fallback_reason: str | None = None):
        self._names = names        # kernel names in name order (numpy array or tuple)
        self._scores = np.asarray(scores, dtype=np.float64)
        self.fallback_reason = fallback_reason
        self._sorted: tuple[tuple[str, ...], tuple[float, ...]] | None = None
        finite = np.isfinite(self._scores)
        # the highest finite prediction (the first name among equals); none finite: the first
        self.best = str(self._names[int(np.argmax(np.where(finite, self._scores, -np.inf)))
                                    if finite.any() else 0])

    def _order(self) -> tuple[tuple[str, ...], tuple[float, ...]]:
        if self._sorted is None:
            # best first; equal predictions in name order (stable sort); non-finite ones last
            keys = np.where(np.isfinite(self._scores), -self._scores, np.inf)
            order = np.argsort(keys, kind="stable")
            self._sorted = (tuple(np.asarray(self._names)[order].tolist()),
                            tuple(self._scores[order].tolist()))
        return self._sorted

    @property
    def kernels(self) -> tuple[str, ...]:
        return self._order()[0]

    @property
    def tflops(self) -> tuple[float, ...]:
        return self._order()[1]

    def __repr__(self) -> str:
        return f"Ranking(best={self.best!r}, candidates={len(self._scores)})"


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RegistryError(f"model artifact {path.parent} has no {what} (no file {path})") from None
    except (OSError, ValueError) as err:
        raise RegistryError(f"corrupt {what} {path}: {err}") from None


def _field(document: Mapping, key: str, kind, path: Path):
    if not isinstance(document, Mapping):
        raise RegistryError(f"{path} holds a {type(document).__name__}, expected a JSON object")
    if key not in document:
        raise RegistryError(f"{path} lacks field {key!r}")
    if not isinstance(document[key], kind):
        raise RegistryError(f"{path} field {key!r} is a {type(document[key]).__name__}, "
                            f"expected {getattr(kind, '__name__', kind)}")
    return document[key]


def _read_shortlist(path: Path, size: int, model: str,
                    version: int | None) -> shortlists.Shortlist:
    """The artifact directory's shortlist, each leaf cut to `size` kernels; RegistryError
    when it has none or cannot be read."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"shortlist={size!r} must be a whole number >= 1 (or 0/None: none)")
    file = path / shortlists.FILE
    if not file.is_file():
        raise RegistryError(f"version {version} of model {model!r} has no {shortlists.FILE} "
                            f"(no file {file}): it was trained without a shortlist (model "
                            "setting shortlist: 0, or before tilecast learned them); select "
                            "without one, or train again")
    try:
        shortlist = shortlists.Shortlist.from_json(_read_json(file, shortlists.FILE), str(file))
    except shortlists.ShortlistError as err:
        raise RegistryError(str(err)) from None
    if size > shortlist.size:
        raise RegistryError(f"{file} keeps at most {shortlist.size} kernels a leaf; "
                            f"shortlist={size} asks for more")
    return shortlist.truncated(size)


def _load_offering(load, path: Path, model: str, version: int | None, root=None):
    """The dispatcher `load()` makes of a verified version, its prebuilt libraries (kernels/)
    offered to their loaders (tilecast.registry.prebuilt): the process libraries first, which
    its scorer loads while it is made (tilecast.runtime.native) and DISCO's calls load (then
    again with those it needs, so that a host without a compiler is told to prebuild the ones
    it lacks), then its candidates' kernels, so that tilecast.runtime.ops runs its choices
    without compiling them; a dispatcher of another kind (a table model) runs no in-process
    kernels."""
    prebuilt.offer_libraries(path, model=model, version=version, registry=root)
    dispatcher = load()
    if isinstance(dispatcher, Dispatcher):
        from tilecast.runtime.prebuild import process_libraries   # the table of who loads what

        prebuilt.offer_libraries(path, model=model, version=version, registry=root,
                                 needed=process_libraries(path, dispatcher.family))
        names = dict.fromkeys((*dispatcher.kernels, dispatcher.static_best))
        prebuilt.offer(path, dispatcher.family.name, names, model=model, version=version,
                       registry=root)
    return dispatcher


class Dispatcher:
    """Picks a kernel per problem from one published model version.

    Attributes: `model` (registry model name), `version`, `family`, `kernels` (candidate
    names), `booster`, `static_best`, `last_fallback_reason` (None unless the last query
    had no applicable candidate), `shortlist` (None: every applicable candidate is scored).

    With a `shortlist` (tilecast.runtime.shortlist; the loaders take `shortlist=K` and read
    the version's shortlist.json, each leaf cut to K kernels) a query scores only the
    applicable kernels of its leaf, all applicable ones when none of them applies: rankings
    then hold those kernels only."""

    kind = kinds.KINDS["family"]

    def __init__(self, booster: lightgbm.Booster, feature_spec: Mapping, candidates: Mapping, *,
                 model: str = "", version: int | None = None, source: Path | None = None,
                 cache_size: int = DEFAULT_CACHE_SIZE,
                 shortlist: shortlists.Shortlist | None = None):
        source = source or Path("<memory>")
        spec_path, cand_path = source / FEATURE_SPEC_FILE, source / CANDIDATES_FILE
        self.booster = booster
        self.model = model
        self.version = version
        self.feature_spec = dict(feature_spec)
        self.last_fallback_reason: str | None = None
        self._cache: dict[Any, Ranking] = {}
        self._raw_cache: dict[Any, Ranking] = {}
        self._masks: dict[Any, tuple[bool, ...]] = {}
        self._cache_size = int(cache_size)

        family_name = _field(feature_spec, "family", str, spec_path)
        try:
            self.family = get_family(family_name)
        except FamilyError as err:
            raise RegistryError(f"{spec_path} field 'family': {err}") from None
        if _field(candidates, "family", str, cand_path) != family_name:
            raise RegistryError(f"{cand_path} family {candidates['family']!r} != "
                                f"{spec_path} family {family_name!r}")
        transform = _field(feature_spec, "target_transform", str, spec_path)
        if transform not in INVERSE_TRANSFORMS:
            raise RegistryError(f"{spec_path} field 'target_transform' is {transform!r}; "
                                f"valid: {', '.join(INVERSE_TRANSFORMS)}")
        self._inverse = INVERSE_TRANSFORMS[transform]

        self.engine = self.family.feature_engine(_field(feature_spec, "hardware", dict, spec_path))
        self._check_engine(feature_spec, spec_path)
        spec_names = _field(feature_spec, "feature_names", list, spec_path)
        self._columns = self._column_map(spec_names, spec_path)
        self._check_booster(spec_names, source / MODEL_FILE)

        kernels = _field(candidates, "kernels", list, cand_path)
        if not kernels:
            raise RegistryError(f"{cand_path} field 'kernels' is empty")
        duplicates = sorted({k for k in kernels if kernels.count(k) > 1})
        if duplicates:
            raise RegistryError(f"{cand_path} lists kernel(s) {duplicates} more than once")
        self.kernels = tuple(kernels)
        self._configs = tuple(self._parse(name, cand_path) for name in self.kernels)
        self.static_best = _field(candidates, "static_best", str, cand_path)
        self._parse(self.static_best, cand_path)
        self._kernel_matrix = self.engine.kernel_features(self._configs)
        # Queries work on the candidates in name order, so a stable sort of the predictions
        # orders equal predictions by name.
        by_name = sorted(range(len(self.kernels)), key=self.kernels.__getitem__)
        self._configs_by_name = tuple(self._configs[i] for i in by_name)
        self._names_by_name = np.array([self.kernels[i] for i in by_name], dtype=object)
        self._scorer = CandidateScorer(self.engine, self._kernel_matrix[by_name],
                                       self._configs_by_name, booster, self._columns,
                                       label=f"model {model!r} version {version}")
        self.shortlist = shortlist
        if shortlist is not None:
            self._shortlist_setup(shortlist, source / shortlists.FILE)

    def _shortlist_setup(self, shortlist: shortlists.Shortlist, path: Path) -> None:
        """Per leaf, its kernels as a mask over the candidates in name order."""
        names, positions = shortlists.shortlist_features(self)
        position = dict(zip(names, positions))
        unknown = sorted(set(shortlist.features) - set(position))
        if unknown:
            raise RegistryError(f"{path} splits on {unknown}, which are not problem features "
                                f"of model {self.model!r}")
        self._shortlist_positions = np.array([position[f] for f in shortlist.features],
                                             dtype=np.intp)
        column = {name: i for i, name in enumerate(self._names_by_name)}
        strangers = sorted({k for kernels in shortlist.leaves for k in kernels} - set(column))
        if strangers:
            raise RegistryError(f"{path} names kernel(s) {strangers[:3]} that are not "
                                f"candidates of model {self.model!r} version {self.version}")
        self._shortlist_masks = []
        for kernels in shortlist.leaves:
            mask = np.zeros(len(column), dtype=bool)
            mask[[column[k] for k in kernels]] = True
            self._shortlist_masks.append(mask)

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_directory(cls, path, *, model: str = "", version: int | None = None,
                       **options) -> "Dispatcher":
        """Load model.txt, feature_spec.json and candidates.json from an artifact directory,
        after checking them against the directory's checksums.json when it has one (a
        registry version's directory does). RegistryError names a damaged file."""
        path = Path(path)
        integrity.verify_directory(path)
        return _load_offering(lambda: cls._load(path, model=model, version=version,
                                                   **options), path, model, version)

    @classmethod
    def _load(cls, path: Path, *, model: str, version: int | None, **options) -> "Dispatcher":
        """Load a verified artifact directory. model.txt is checked for truncation before
        LightGBM reads it: its loader crashes the process on a truncated file instead of
        raising (a version without checksums has nothing else to catch that). A table
        model of another kind (tilecast.core.kinds) loads as its own dispatcher."""
        # lightgbm is slow to import (sklearn, scipy): only loading a model pays for it,
        # not `import tilecast.runtime.dispatch` (parse_problem_string, the CLI's parser)
        import lightgbm

        model_path = path / MODEL_FILE
        if not model_path.is_file():
            raise RegistryError(f"model artifact {path} has no {MODEL_FILE} (no file {model_path})")
        feature_spec = _read_json(path / FEATURE_SPEC_FILE, FEATURE_SPEC_FILE)
        size = options.pop("shortlist", None)
        kind = kinds.of_spec(feature_spec)
        if size and not kind.shortlist:
            raise RegistryError(f"version {version} of model {model!r} is a {kind.name} model; "
                                "it has no shortlist")
        loader = kind.dispatcher_class()
        if loader is not cls:   # another kind's dispatcher reads its own files
            return loader.load(path, model=model, version=version, **options)
        candidates = _read_json(path / CANDIDATES_FILE, CANDIDATES_FILE)
        if size:
            options["shortlist"] = _read_shortlist(path, size, model, version)
        integrity.check_model_text(model_path)
        try:
            booster = lightgbm.Booster(model_file=str(model_path))
        except (lightgbm.basic.LightGBMError, ValueError) as err:  # ValueError: its last line
            raise RegistryError(f"corrupt LightGBM model {model_path}: {err}") from None
        return cls(booster, feature_spec, candidates, model=model, version=version,
                   source=path, **options)

    @classmethod
    def from_registry(cls, root, model: str, alias: str | int = "production", *,
                      cache_dir=None, **options) -> "Dispatcher":
        """The dispatcher for the version `alias` (an alias name or a version number) of
        `model` in the registry at `root`, a local path or an fsspec URL. The version's files
        are verified against its checksums first (registry.local_copy): a damaged version is
        a RegistryError naming the file, which `tilecast.runtime.serving` answers with the
        last good version or the caller's static kernel. A remote version is loaded from a
        local copy downloaded once (tilecast.registry.cache; `cache_dir` overrides where).
        `model` without a hardware class serves this host's class's model, or the nearest
        class's with a warning (tilecast.registry.classes)."""
        model = registry.serving_name(root, model)
        version = registry.resolve_version(root, model, alias)
        path = registry.local_copy(root, model, version, cache_dir=cache_dir)
        try:
            return _load_offering(lambda: cls._load(path, model=model, version=version,
                                                       **options), path, model, version, root)
        except RegistryError as err:
            if not registry.is_remote(root):
                raise
            # the message names the cache copy; say where it came from
            raise RegistryError(f"{err} [version {version} of model {model!r} from "
                                f"{registry.version_path(root, model, version)}]") from None

    def _parse(self, name, cand_path: Path):
        if not isinstance(name, str):
            raise RegistryError(f"{cand_path}: kernel name {name!r} is not a string")
        try:
            return self.family.parse_name(name)
        except FamilyError as err:
            raise RegistryError(f"{cand_path}: {err}") from None

    def _check_engine(self, spec: Mapping, spec_path: Path) -> None:
        engine_name = spec.get("engine")
        if engine_name is not None and engine_name not in (self.engine.name,
                                                           type(self.engine).__name__):
            raise RegistryError(f"{spec_path} field 'engine' is {engine_name!r}, but family "
                                f"{self.family.name!r} provides {self.engine.name!r}")
        engine_version = spec.get("engine_version")
        # An older engine version is fine: its features are looked up by name in the current
        # engine (_column_map). A newer one may need features this install cannot compute.
        if engine_version is not None and engine_version > self.engine.version:
            raise RegistryError(f"{spec_path} field 'engine_version' is {engine_version!r}, newer "
                                f"than the installed {self.engine.name!r} engine (version "
                                f"{self.engine.version}); upgrade tilecast")

    def _column_map(self, spec_names: list, spec_path: Path) -> np.ndarray | None:
        """None when the engine's columns are the model's; else the engine column of each
        model feature. A model feature the engine cannot compute is an error."""
        engine_names = list(self.engine.feature_names())
        if list(spec_names) == engine_names:
            return None
        position = {name: i for i, name in enumerate(engine_names)}
        missing = [name for name in spec_names if name not in position]
        if missing:
            raise RegistryError(f"{spec_path} needs feature(s) {missing} that the "
                                f"{self.engine.name!r} engine does not compute")
        return np.array([position[name] for name in spec_names], dtype=np.intp)

    def _check_booster(self, spec_names: list, model_path: Path) -> None:
        if self.booster.num_feature() != len(spec_names):
            raise RegistryError(f"{model_path} expects {self.booster.num_feature()} features, "
                                f"feature_spec.json lists {len(spec_names)}")
        booster_names = list(self.booster.feature_name())
        generic = [f"Column_{i}" for i in range(len(booster_names))]
        if booster_names not in (generic, list(spec_names)):
            raise RegistryError(f"{model_path} feature names differ from feature_spec.json "
                                f"'feature_names'")

    # -- queries --------------------------------------------------------------------------

    def problem(self, problem) -> Any:
        """The family's validated problem from a mapping, a 'k=v,k=v' string or a problem
        object; FamilyError (ProblemError for a string) names the offending field."""
        if isinstance(problem, str):
            return parse_problem(problem, self.family)
        if dataclasses.is_dataclass(problem) and not isinstance(problem, type):
            problem = self.family.problem_dict(problem)
        elif not isinstance(problem, Mapping):
            raise TypeError(f"problem must be a mapping, a 'k=v,...' string or a "
                            f"{self.family.name} problem, got {type(problem).__name__}")
        return self.family.problem(problem)

    def ranking(self, problem) -> Ranking:
        """The memoized Ranking for a problem (the same object on every call). A repeated
        query is found by its raw form (the string, or the mapping's items) before any
        validation, so a memoized problem costs one dictionary lookup."""
        given = raw_key(problem)
        found = self._raw_cache.get(given) if given is not None else None
        if found is None:
            found = self.validated_ranking(self.problem(problem))
            if given is not None:
                if len(self._raw_cache) >= self._cache_size:
                    self._raw_cache.pop(next(iter(self._raw_cache)))
                self._raw_cache[given] = found
        self.last_fallback_reason = found.fallback_reason
        return found

    def validated_ranking(self, problem) -> Ranking:
        """ranking() of a problem the family has validated already (family.problem's
        result), without validating it again: what learning a shortlist asks thousands of
        times (tilecast.runtime.shortlist)."""
        found = self._cache.get(problem)
        if found is None:
            found = self._rank_uncached(problem)
            if len(self._cache) >= self._cache_size:
                self._cache.pop(next(iter(self._cache)))  # oldest entry first
            self._cache[problem] = found
        return found

    def _applicable(self, problem) -> tuple[bool, ...]:
        """Which candidates apply; memoized per family.applicability_key (GEMM: the dtype),
        computed per query where the key is None."""
        key = self.family.applicability_key(problem)
        applies = self._masks.get(key) if key is not None else None
        if applies is None:
            applies = tuple(map(self.family.applicable, self._configs_by_name, repeat(problem)))
            if key is not None:
                self._masks[key] = applies
        return applies

    def _rank_uncached(self, problem) -> Ranking:
        applies = self._applicable(problem)
        if not any(applies):
            return self._fallback(problem)
        index = None if all(applies) else np.flatnonzero(applies).astype(np.int64, copy=False)
        if self.shortlist is not None:
            values = self.engine.problem_features(problem)[self._shortlist_positions]
            listed = self._shortlist_masks[self.shortlist.leaf(values)] & np.asarray(applies)
            if listed.any():
                index = np.flatnonzero(listed).astype(np.int64, copy=False)
        tflops = self._scorer.raw_scores(problem, index)
        self._inverse(tflops, out=tflops)
        names = self._names_by_name if index is None else self._names_by_name[index]
        return Ranking(names, tflops)

    def _fallback(self, problem) -> Ranking:
        """The static best for a problem no candidate applies to, when it applies itself (the
        Ranking says why it was chosen); NoKernelError when it does not either: a kernel that
        cannot run the problem (an fp32 kernel for a bf16 problem) is never returned."""
        problem_key = self.family.dims_key(problem)
        static = self.family.parse_name(self.static_best)
        if not self.family.applicable(static, problem):
            why = self.family.unsupported_reason(static, problem) or "it does not apply either"
            raise NoKernelError(
                f"no kernel of model {self.model!r} version {self.version} can run problem "
                f"{problem_key}: none of its {len(self.kernels)} candidates applies, nor its "
                f"static best {self.static_best!r} ({why}); use a model whose candidates "
                "cover such problems")
        reason = (f"no candidate of model {self.model!r} version {self.version} applies to "
                  f"problem {problem_key}; falling back to the static best {self.static_best!r}")
        logger.warning(reason)
        return Ranking((self.static_best,), (math.nan,), reason)

    def select(self, problem) -> str:
        """The name of the kernel predicted fastest for `problem`: the static best when no
        candidate applies but it does (see `last_fallback_reason`); NoKernelError when no
        kernel of the model can run the problem."""
        return self.ranking(problem).best

    def rank(self, problem, k: int = 5) -> list[tuple[str, float]]:
        """The k best (kernel name, predicted TFLOP/s) pairs, best first."""
        if k < 1:
            raise ValueError(f"k={k} must be >= 1")
        ranking = self.ranking(problem)
        return list(zip(ranking.kernels[:k], ranking.tflops[:k]))

    def predict(self, problem) -> dict[str, float]:
        """Predicted TFLOP/s of every applicable candidate ({} when none applies)."""
        ranking = self.ranking(problem)
        if ranking.fallback_reason is not None:
            return {}
        return dict(zip(ranking.kernels, ranking.tflops))

    def select_json(self, problem) -> dict:
        """{"kernel", "predicted_tflops", "model", "version"} for `tilecast select --json`;
        predicted_tflops is None (and "fallback" says why) when no candidate applies."""
        ranking = self.ranking(problem)
        result = {"kernel": ranking.kernels[0], "predicted_tflops": ranking.tflops[0],
                  "model": self.model, "version": self.version}
        if ranking.fallback_reason is not None:
            result["predicted_tflops"] = None
            result["fallback"] = ranking.fallback_reason
        return result

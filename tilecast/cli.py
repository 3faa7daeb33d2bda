"""The `tilecast` command line: library subcommands (no Prefect). `tilecast.flows.cli` adds `run`.

Every error a user can cause ends the command with one line on stderr, `tilecast <command>:
error: <message>`, and exit status 2; any other exception is a bug and keeps its traceback.
The errors a user can cause are the classes of USER_ERRORS, raised where input is parsed or
read; the paths given on the command line are checked here first (`user_file`, `user_dir`,
`registry_root`), so that a missing, unreadable or binary file, or a directory given as a
file, is named before any work starts. Subcommands import what they run when they run it:
a mistyped command fails in a fraction of a second.
"""
from __future__ import annotations

import argparse
import codecs
import json
import logging
import os
import signal
import stat
import sys
from pathlib import Path

log = logging.getLogger("tilecast.cli")


class CliError(Exception):
    """A user error found by the command line itself: printed as one line, exit status 2."""


#: The errors a user can cause, as (module, class): the one list the boundary catches.
#: Resolved when an error reaches `main` (user_errors), from the modules loaded by then: an
#: error of a module that was never imported cannot have been raised.
USER_ERRORS = (
    ("tilecast.cli", "CliError"),                       # bad arguments and paths
    ("tilecast.core.config", "ConfigError"),            # configs and problem files
    ("tilecast.core.dataset", "DatasetError"),          # raw logs, CSVs, parquet datasets
    ("tilecast.families.base", "FamilyError"),          # kernel names, problems (ProblemError)
    ("tilecast.registry.base", "RegistryError"),        # registries, versions, aliases
    ("tilecast.runtime.dispatch", "NoKernelError"),     # a problem no kernel of a model runs
    ("tilecast.runtime.export", "ExportError"),         # a model version export cannot carry
    ("tilecast.stages.train", "ModelArtifactError"),    # a model directory a run left
    ("tilecast.workflows.rebench", "RebenchError"),     # rebench inputs and history
    ("tilecast.workflows.user_eval", "EvaluationError"),  # problems with nothing to score
    ("tilecast.table.transfer", "TransferError"),       # cross-hardware evaluation options
    ("tilecast.table.dataset", "TableDataError"),       # imported datasets, device tables
    ("tilecast.store.store", "StoreError"),             # measurement stores
    ("tilecast.workflows.fleet", "FleetError"),         # fleet nights: pools, shards, classes
)


def user_errors() -> tuple[type[BaseException], ...]:
    """The classes of USER_ERRORS whose modules are loaded."""
    return tuple(getattr(sys.modules[module], name) for module, name in USER_ERRORS
                 if module in sys.modules)


def one_line(message: str) -> str:
    """A message on one line: its lines joined (a YAML error's caret line left out)."""
    lines = (line.strip() for line in str(message).splitlines())
    return " ".join(line for line in lines if line and line != "^")


# -- the paths a user gives -----------------------------------------------------------------

CHUNK_BYTES = 1 << 20


def _check_text(handle, path: Path, what: str) -> None:
    """CliError unless the open file is UTF-8 text without NUL bytes (a binary file)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    while chunk := handle.read(CHUNK_BYTES):
        nul = chunk.find(b"\0")
        if nul >= 0:
            raise CliError(f"{what} {path} is a binary file (a NUL byte at offset "
                           f"{offset + nul}), expected text")
        pending = len(decoder.getstate()[0])
        try:
            decoder.decode(chunk)
        except UnicodeDecodeError as err:
            raise CliError(f"{what} {path} is not UTF-8 text (byte 0x{err.object[err.start]:02x} "
                           f"at offset {offset - pending + err.start})") from None
        offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise CliError(f"{what} {path} is not UTF-8 text (it ends inside a character)") from None


def user_file(value: str | Path, what: str, *, text: bool = False) -> Path:
    """`value` as a file the user named (`what` says which in messages): CliError when it
    does not exist, is not a regular file, cannot be read or, with `text`, is not UTF-8 text."""
    path = Path(value)
    try:
        with open(path, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise CliError(f"{what} {path} is not a regular file")
            if text:
                _check_text(handle, path, what)
            else:
                handle.read(1)
    except FileNotFoundError:
        raise CliError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise CliError(f"{what} {path} is a directory, expected a file") from None
    except PermissionError:
        raise CliError(f"{what} {path} is not readable (permission denied)") from None
    except OSError as err:
        raise CliError(f"{what} {path} cannot be read: {err.strerror or err}") from None
    return path


def user_dir(value: str | Path, what: str, *, must_exist: bool = False,
             writable: bool = False) -> Path:
    """`value` as a directory the user named: CliError when it is something else, when it
    does not exist (with `must_exist`), or when it (or, not made yet, the directory it would
    be made in) cannot be written (with `writable`)."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise CliError(f"{what} {path} is a file, expected a directory")
    if not path.exists() and must_exist:
        raise CliError(f"{what} {path} does not exist")
    if writable:
        _check_writable(path, what)
    return path


def user_output(value: str | Path, what: str) -> Path:
    """`value` as a file the command writes: CliError when it is a directory or when the
    directory it goes in cannot be written."""
    path = Path(value)
    if path.is_dir():
        raise CliError(f"{what} {path} is a directory; name the file to write")
    _check_writable(path.parent, what)
    return path


def _check_writable(path: Path, what: str) -> None:
    existing = next((p for p in (path, *path.absolute().parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise CliError(f"{what} {path}: {existing} is a file, not a directory")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise CliError(f"{what} {path}: {existing} is not writable (permission denied)")


CONFIG_SUFFIXES = (".yaml", ".yml", ".json")  # core.config.CONFIG_SUFFIXES


def config_arg(value: str | Path) -> str:
    """A --config value: a path (one that exists, has a directory part or a YAML/JSON suffix)
    is checked as a text file; a bare name (`quick`) is left to the loader, which looks it
    up in configs/ and lists the names there when it is not one."""
    path = Path(value)
    if path.exists() or len(path.parts) > 1 or path.suffix in CONFIG_SUFFIXES:
        user_file(path, "config", text=True)
    return str(value)


def registry_root(value: str | Path, *, must_exist: bool = True) -> str:
    """A --registry value: a local path must be a directory (and exist, for a command that
    reads it); a URL is left to its store, which names it in its own errors."""
    from tilecast.registry.api import is_url

    if not is_url(value):
        path = Path(value)
        if path.exists() and not path.is_dir():
            raise CliError(f"registry {path} is a file; --registry names a directory or a URL")
        if must_exist and not path.exists():
            raise CliError(f"registry {path} does not exist; --registry names a directory "
                           "(default ./registry) or a URL such as s3://bucket/prefix")
    return str(value)


# -- subcommands ----------------------------------------------------------------------------

def _cmd_select(args) -> int:
    from tilecast.runtime.dispatch import Dispatcher, parse_problem_string

    parse_problem_string(args.problem)  # a malformed string fails before the model is loaded
    shortlist = _shortlist_size(args.shortlist)
    dispatcher = Dispatcher.from_registry(registry_root(args.registry), args.model, args.alias,
                                          **({"shortlist": shortlist} if shortlist else {}))
    # only a table model answers per device (tilecast.table.dispatch.TableDispatcher)
    table = getattr(dispatcher, "family", None) == "table"
    if args.device is not None and not table:
        raise CliError(f"--device {args.device}: model {args.model!r} is a "
                       f"{dispatcher.family.name} model, which chooses for the machine it was "
                       "trained on; --device is for table models (tilecast train --dataset)")
    if args.candidates is not None and not table:
        raise CliError(f"--candidates: model {args.model!r} is a {dispatcher.family.name} "
                       "model, which ranks its own kernels; --candidates is for table models")
    options = {"device": args.device} if table else {}
    if args.candidates is not None:
        options["candidates"] = _candidates(args.candidates)
    if args.json:
        print(json.dumps(dispatcher.select_json(args.problem, **options)))
    else:
        print(dispatcher.select(args.problem, **options))
    return 0


def _candidates(text: str) -> list[str]:
    """--candidates: configuration keys separated by ';', or @FILE with one key a line."""
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            lines = path.read_text().splitlines()
        except OSError as err:
            raise CliError(f"--candidates {text}: cannot read {path}: "
                           f"{err.strerror or err}") from None
    else:
        lines = text.split(";")
    keys = [line.strip() for line in lines if line.strip()]
    if not keys:
        raise CliError(f"--candidates {text!r} names no configuration")
    return keys


def _shortlist_size(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise CliError(f"--shortlist {value} must be a number of kernels >= 1")
    return value


def _cmd_export(args) -> int:
    from tilecast.runtime import export

    out = user_dir(args.out, "--out", writable=True)
    alias = args.version if args.version is not None else args.alias
    selector = export.load(registry_root(args.registry), args.model, alias,
                           shortlist=_shortlist_size(args.shortlist))
    paths = export.write(selector, out, args.format)
    shortlist = "" if selector.shortlist is None else \
        f", a shortlist of {args.shortlist} ({len(selector.shortlist_rows)} leaves)"
    print(f"{args.model} version {selector.version}: {selector.candidates} candidates, "
          f"{len(selector.forest.roots)} trees, {len(selector.forest.slot)} splits{shortlist} -> "
          + ", ".join(str(path) for path in paths))
    return 0


def _cmd_train(args) -> int:
    from tilecast.table.train import train_table

    if args.rounds < 1:
        raise CliError(f"--rounds {args.rounds} must be a positive number of boosting rounds")
    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads {args.threads} must be a positive number")
    summary = train_table(user_dir(args.dataset, "dataset", must_exist=True),
                          user_dir(args.workdir, "workdir", writable=True),
                          devices_files=[user_file(path, "devices file", text=True)
                                         for path in args.devices],
                          exclude_devices=args.exclude_device or (), rounds=args.rounds,
                          **({"formulation": args.formulation} if args.formulation else {}),
                          threads=args.threads)
    print(summary.line())
    return 0


def _cmd_publish(args) -> int:
    from tilecast.table.train import publish_table

    workdir = user_dir(args.workdir, "workdir", must_exist=True)
    result = publish_table(workdir, registry_root(args.registry, must_exist=False), args.model)
    print(f"{args.model}: version {result.version} "
          f"{'promoted' if result.promoted else 'not promoted'} "
          f"(aliases {', '.join(result.aliases)}): {result.reason}")
    return 0


def _cmd_convert(args) -> int:
    inputs = [user_file(p, "input", text=True) for p in args.inputs]
    out = user_output(args.out, "--out")
    if args.source == "ck-csv":
        from tilecast.stages.convert_ck import convert_ck_csv

        summary = convert_ck_csv(inputs, out, problem_set=args.problem_set)
    else:
        from tilecast.stages.convert import convert_raw

        summary = convert_raw(inputs, out)
    print(f"wrote {summary.out_path}: {summary.rows} rows, {summary.problems} problems, "
          f"{summary.kernels} kernels, statuses {summary.statuses}")
    return 0


def _version_summary(root, model: str, version: int) -> dict:
    """What `registry list/show` print for one version: headline metrics, promotion, lineage."""
    from tilecast.registry import api as registry
    from tilecast.stages import layout

    path = registry.version_path(root, model, version)
    summary: dict = {"version": version, "path": str(path)}
    for name, keys in ((registry.METRICS_FILE, ("mean_efficiency", "median_efficiency",
                                                 "p10_efficiency", "top1", "top5", "n_problems")),
                       (registry.PROMOTION_FILE, ("promoted", "reason", "published_at")),
                       (layout.MANIFEST_FILE, ("created", "git_sha", "data_hash", "rows",
                                               "lineage"))):
        try:
            document = json.loads(registry.read_version_file(root, model, version, name))
        except (registry.RegistryError, ValueError) as err:
            summary[name] = f"unreadable: {err}"
            continue
        if not isinstance(document, dict):
            summary[name] = f"unreadable: holds a {type(document).__name__}, not an object"
            continue
        summary.update({k: document[k] for k in keys if k in document})
    return summary


def _cmd_import(args) -> int:
    from tilecast.table.importing import import_files

    paths = [user_file(path, "input") for path in args.inputs]
    mapping = user_file(args.mapping, "mapping", text=True) if args.mapping else None
    devices = [user_file(path, "devices file", text=True) for path in args.devices]
    out = user_dir(args.out, "--out", writable=True)
    summary = import_files(args.source, paths, out, mapping_path=mapping, device=args.device,
                           devices_files=devices)
    print(summary.line())
    return 0


def _cmd_repeatability(args) -> int:
    from tilecast.workflows.repeatability import is_store, report, store_report

    if not 0.0 <= args.tie_threshold_pct < 100.0:
        raise CliError(f"--tie-threshold-pct {args.tie_threshold_pct:g} must be a percentage "
                       "from 0 to 100, e.g. 1")
    stores = [is_store(run) for run in args.runs]
    if any(stores):
        if not all(stores):
            raise CliError("compare two stores (two series of nights) or two runs, not one "
                           f"of each: {args.runs[stores.index(False)]} is not a store")
        if args.nights is not None and args.nights < 1:
            raise CliError(f"--nights {args.nights} must be at least 1")
        print(store_report(args.runs[0], args.runs[1], args.family, args.tie_threshold_pct,
                           args.hardware_class, args.nights))
        return 0
    for run in args.runs:
        path = Path(run)
        if not path.is_dir():
            with user_file(path, "run").open("rb") as handle:
                if handle.read(4) != b"PAR1":
                    raise CliError(f"run {path} is neither a workdir, a store nor a parquet "
                                   "dataset (`tilecast convert` writes one)")
    print(report(args.runs[0], args.runs[1], args.family, args.tie_threshold_pct))
    return 0


def _cmd_plan(args) -> int:
    from tilecast.store.store import Store
    from tilecast.workflows import pipeline

    Store(args.store).require()
    ctx = pipeline.RunContext.create(config_arg(args.config), ".", "registry", store=args.store,
                                     budget_minutes=args.budget_minutes)
    if not ctx.config.night.budget_minutes:
        raise CliError(f"config {ctx.config.name} has no night.budget_minutes; give "
                       "--budget-minutes")
    families = [args.family] if args.family else list(ctx.config.families)
    for name in families:
        family = pipeline._family(ctx, name)[0]
        kernels = [family.kernel_name(c) for c in pipeline.select_candidates(ctx, name)]
        plan = pipeline.make_plan(ctx, name, kernels)
        if plan is None:
            print(f"{name}: the store has no night of class {ctx.hardware['hardware_class']} "
                  "yet; tonight measures the config's problem lists")
            continue
        print("\n".join(plan.lines()))
        for chosen in plan.chosen[:args.show]:
            score = "" if chosen.score is None else f"  regret {chosen.score:.3f}"
            print(f"  {chosen.reason:9s} {chosen.dims_key}  {chosen.seconds:.1f} s{score}")
        if len(plan.chosen) > args.show:
            print(f"  ... and {len(plan.chosen) - args.show} more (--show)")
    return 0


def _cmd_replay(args) -> int:
    from tilecast.workflows import replay

    for name in ("start", "step", "steps", "seeds", "rounds"):
        if getattr(args, name) < (0 if name == "steps" else 1):
            raise CliError(f"--{name} {getattr(args, name)} must be at least "
                           f"{0 if name == 'steps' else 1}")
    print("\n".join(replay.store_replay(
        args.store, config_arg(args.config), args.family, policies=args.policies,
        hardware_class=args.hardware_class, start=args.start, step=args.step, steps=args.steps,
        seeds=list(range(args.seeds)), rounds=args.rounds, out=args.out)))
    return 0


def _cmd_store(args) -> int:
    from tilecast.store import nights
    from tilecast.store.store import Store

    store = Store(args.store)
    if args.action == "add":
        if not args.workdirs:
            raise CliError("store add needs one or more WORKDIRs")
        for workdir in args.workdirs:
            user_dir(workdir, "workdir", must_exist=True)
        for workdir in args.workdirs:
            for appended in nights.add_workdir(store, workdir, args.hardware_class):
                print(f"{workdir}: {appended.line()}")
        return 0
    if args.workdirs:
        raise CliError(f"store {args.action} takes no WORKDIR (got {args.workdirs[0]})")
    if args.action == "summary":
        print("\n".join(nights.summary_lines(nights.summary(store.require()))))
        return 0
    damage = store.check()
    for item in damage:
        print(f"{item.path}: {item.why}")
    print(f"{len(store.parts())} record files; {len(damage)} damaged, foreign or left over")
    return 1 if damage else 0


def _cmd_registry(args) -> int:
    from tilecast.registry import api as registry

    from tilecast.registry import classes

    root = registry_root(args.registry)
    if args.action == "list":
        names = registry.list_models(root)
        models = [m for m in names if args.model in (None, m, classes.split(m)[0])]
        if not models:
            raise CliError(f"registry {root} holds no model" + (f" {args.model!r}" if args.model
                                                                 else ""))
        for model in models:
            name, hardware_class = classes.split(model)
            aliases = registry.list_aliases(root, model)
            print(f"{name} [{hardware_class or 'no hardware class'}]: versions "
                  f"{registry.list_versions(root, model) or 'none'}; aliases "
                  + (", ".join(f"{a} -> {v}" for a, v in aliases.items()) or "none"))
        return 0
    if not args.model:
        raise CliError(f"registry {args.action} needs MODEL")
    if args.action == "show":
        args.model = registry.serving_name(root, args.model)
        number = registry.resolve_version(root, args.model, args.version or args.alias)
        aliases = [a for a, v in registry.list_aliases(root, args.model).items() if v == number]
        print(json.dumps({"model": args.model, "aliases": aliases,
                          **_version_summary(root, args.model, number)}, indent=2))
        return 0
    if args.action == "promote" and not args.version:
        raise CliError("registry promote needs VERSION")
    args.model = _class_to_move(root, args.model)
    try:
        if args.action == "promote":
            previous = registry.promote(root, args.model, args.version, args.alias)
            print(f"{args.model}: alias {args.alias} -> version {int(args.version)} "
                  f"(was {previous if previous is not None else 'unset'})")
        else:
            version = registry.rollback(root, args.model, args.alias)
            print(f"{args.model}: alias {args.alias} rolled back to version {version}")
    except PermissionError as err:
        raise CliError(f"registry {root} is not writable: {err.strerror} ({err.filename}); "
                       "ask its owner, or use a registry you can write") from None
    return 0


def _class_to_move(root, model: str) -> str:
    """The registered model a promote or rollback of `model` acts on: `model` itself when it
    names a class or a classless model, else this host's class's; CliError naming the
    classes when this host has none."""
    from tilecast.registry import api as registry, classes

    names = registry.list_models(root)
    if classes.split(model)[1] is not None or model in names:
        return model
    registered = classes.classes(names, model)
    own = classes.class_model(model, classes.host_class())
    if own in names:
        return own
    raise CliError(f"registry {root}: model {model!r} has versions for hardware classes "
                   f"{registered or 'none'}, none of them this host's: name one as "
                   f"{model}@<class>")


#: `evaluate`'s two modes and the options of each (argparse dests; None = not given).
EVALUATE_MODES = {"--model": ("model", "problems", "registry", "alias", "config"),
                  "--dataset": ("dataset", "split", "devices", "rounds", "default_config",
                                "threads", "formulation")}
EVALUATE_USAGE = ("give --model M --problems FILE (score a published model on your own "
                  "problems) or --dataset DIR (evaluate a table model across devices)")


def _option(dest: str) -> str:
    return "--" + {"default_config": "default"}.get(dest, dest)


def _evaluate_mode(args) -> str:
    """'--model' or '--dataset': the mode the given options belong to; CliError when they mix
    the two or lack what their mode needs."""
    given = {mode: [d for d in dests if getattr(args, d) is not None]
             for mode, dests in EVALUATE_MODES.items()}
    if given["--model"] and given["--dataset"]:
        raise CliError(f"{', '.join(map(_option, given['--model']))} and "
                       f"{', '.join(map(_option, given['--dataset']))} belong to different "
                       f"modes of evaluate; {EVALUATE_USAGE}, not both")
    if given["--dataset"]:
        if args.dataset is None:
            raise CliError(f"{', '.join(map(_option, given['--dataset']))} need(s) --dataset "
                           "DIR (an imported dataset to evaluate across devices)")
        return "--dataset"
    missing = [_option(d) for d in ("model", "problems") if getattr(args, d) is None]
    if missing:
        raise CliError(f"{' and '.join(missing)} missing; {EVALUATE_USAGE}")
    return "--model"


def _cmd_evaluate_dataset(args) -> int:
    from tilecast.table.dataset import read_dataset
    from tilecast.table.devices import DeviceTable
    from tilecast.table.transfer import run_transfer
    from tilecast.table.transfer_report import overall_line, write_report

    if args.rounds is not None and args.rounds < 1:
        raise CliError(f"--rounds {args.rounds} must be a positive number of boosting rounds")
    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads {args.threads} must be a positive number")
    dataset = read_dataset(user_dir(args.dataset, "dataset", must_exist=True))
    workdir = user_dir(args.workdir, "workdir", writable=True)
    extra = [user_file(path, "devices file", text=True) for path in args.devices or ()]
    devices = DeviceTable.load(extra=extra)
    options = {"rounds": args.rounds} if args.rounds is not None else {}
    result = run_transfer(dataset, devices, split=args.split or "leave-one-device-out",
                          threads=args.threads, default=args.default_config,
                          formulation=args.formulation, **options)
    for path in write_report(workdir, result):
        print(f"evaluate: wrote {path}", file=sys.stderr)
    print(overall_line(result.report))
    return 0


def _cmd_evaluate(args) -> int:
    if _evaluate_mode(args) == "--dataset":
        return _cmd_evaluate_dataset(args)
    from tilecast.workflows.user_eval import dump, evaluate_published, summary_line

    user_file(args.problems, "problems file", text=True)
    metrics = evaluate_published(registry_root(args.registry or "registry"), args.model,
                                 args.problems, user_dir(args.workdir, "workdir", writable=True),
                                 alias=args.alias or "production",
                                 config=config_arg(args.config or "quick"))
    print(dump(metrics))
    print(summary_line(metrics), file=sys.stderr)
    return 0


def _cmd_rebench(args) -> int:
    from tilecast.workflows.rebench import rebench

    families = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else None
    if args.families is not None and not families:
        raise CliError(f"--families {args.families!r} names no family; e.g. --families gemm")
    result = rebench(config_arg(args.config), user_dir(args.workdir, "workdir", writable=True),
                     user_dir(args.history, "history", writable=True), families=families,
                     problems=args.problems, git_ref=args.git_ref, repo=args.repo,
                     alpha=args.alpha, min_effect=args.min_effect, samples=args.samples)
    print(result.markdown)
    for family, path in result.reports.items():
        print(f"rebench {family}: report {path}", file=sys.stderr)
    return result.exit_status


def _config_summary(config) -> str:
    """One line on a valid config: its name and each family's problems per set."""
    families = "; ".join(
        f"{name} " + " + ".join(f"{len(problems)} {problem_set}"
                                for problem_set, problems in family.problems.items())
        + " problems" for name, family in config.families.items())
    count = len(config.families)
    return (f"{config.path}: config {config.name!r}, {count} "
            f"{'family' if count == 1 else 'families'} ({families})")


def _cmd_config_check(args) -> int:
    # the schema module is imported only by the command that needs it
    from tilecast.core.schema import check_config_file

    config = check_config_file(Path(config_arg(args.file)))
    print(f"ok: {_config_summary(config)}")
    return 0


def _cmd_config_schema(args) -> int:
    from tilecast.core.schema import config_json_schema

    print(json.dumps(config_json_schema(), indent=2))
    return 0


REBENCH_EPILOG = """\
exit status:
  0  nothing regressed (also a first run, which has no baseline yet)
  1  regression(s) found: a kernel slower on its problems, or broken where it worked
  2  usage error or bad input (unknown family or problem, bad git ref, unreadable history)
  3  not comparable: the hardware differs from the baseline's, or no pair was measured
     validly in both runs (1 wins when another family regressed)

A verdict needs a significant test and a practical effect. The tests: per kernel and problem,
a two-sided Welch t-test on the logs of the two runs' per-round medians (each round is a
process of its own; records without rounds fall back to a Mann-Whitney U test on their
samples); per kernel, a Wilcoxon signed-rank test on the logs of its time ratios across
problems; every test of a run corrected with Benjamini-Hochberg, significant at q <= ALPHA.
The effect: a time ratio of at least 1 + MIN_EFFECT, or at most 1 / (1 + MIN_EFFECT).
"""


REGISTRY_HELP = ("a directory (default ./registry) or an fsspec URL such as s3://bucket/prefix; "
                 "S3 credentials and endpoint come from the environment (AWS_*)")
CONFIG_HELP = "a YAML path, or the name of a shipped config (tiny, quick, nightly, ...)"


def build_parser() -> argparse.ArgumentParser:
    """The parser with every library subcommand; callers may add more."""
    parser = argparse.ArgumentParser(prog="tilecast", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging (and the traceback behind an error message)")
    sub = parser.add_subparsers(dest="command", required=True)

    select = sub.add_parser("select", help="print the kernel the published model chooses")
    select.add_argument("--registry", default="registry", help=REGISTRY_HELP)
    select.add_argument("--model", required=True)
    select.add_argument("--alias", default="production")
    select.add_argument("--problem", required=True, help="e.g. 'm=512,n=512,k=512'")
    select.add_argument("--json", action="store_true")
    select.add_argument("--shortlist", type=int, default=None, metavar="K",
                        help="score only the (at most K) candidates of the version's "
                             "shortlist leaf for the problem (see tilecast.runtime.shortlist)")
    select.add_argument("--device", default=None,
                        help="table models: the device to choose for (a name or label of the "
                             "hardware table; default: the model's only training device)")
    select.add_argument("--candidates", default=None, metavar="KEYS",
                        help="table models: rank only these configurations, the ones offered "
                             "for this problem: keys separated by ';' (a one-column "
                             "configuration's bare values will do) or @FILE, one a line")
    select.set_defaults(func=_cmd_select)

    export = sub.add_parser(
        "export", help="write a published model as a C selector (or JSON) that picks what "
                       "`tilecast select` picks, without Python",
        description="Write version V (or the version --alias names) of model M as "
                    "tilecast_<model>.h + tilecast_<model>.c (--format c: a function "
                    "tilecast_<model>_select(problem fields) returning a kernel index, and a "
                    "name lookup) or tilecast_<model>.json (--format json: the same tables "
                    "for other runtimes). The version's checksums are verified first. "
                    "Families: gemm.")
    export.add_argument("--registry", default="registry", help=REGISTRY_HELP)
    export.add_argument("--model", required=True)
    which = export.add_mutually_exclusive_group()
    which.add_argument("--version", type=int, default=None, help="a version number")
    which.add_argument("--alias", default="production", help="an alias (default production)")
    export.add_argument("--out", required=True, metavar="DIR", help="directory to write into")
    export.add_argument("--format", choices=("c", "json"), default="c")
    export.add_argument("--shortlist", type=int, default=None, metavar="K",
                        help="score only the (at most K) candidates of the version's "
                             "shortlist leaf, as `tilecast select --shortlist K` does: a "
                             "query costs trees x K instead of trees x candidates (the "
                             "version's evaluation says what each K costs in efficiency)")
    export.set_defaults(func=_cmd_export)

    train = sub.add_parser(
        "train", help="train a table model on an imported dataset (tilecast import)",
        description="Train a model that chooses a configuration per problem and device from "
                    "an imported dataset, calibrate its confidence on out-of-fold picks and "
                    "write WORKDIR/models/table/; prints a one-line summary.")
    train.add_argument("--dataset", required=True, help="an imported dataset directory")
    train.add_argument("--workdir", required=True)
    train.add_argument("--devices", action="append", default=[], metavar="DEVICES.yaml",
                       help="a hardware table adding to or replacing the shipped devices "
                            "(repeatable)")
    train.add_argument("--exclude-device", action="append", default=None, metavar="NAME",
                       help="leave this device's measurements out (repeatable)")
    train.add_argument("--rounds", type=int, default=300, help="boosting rounds (default 300)")
    train.add_argument("--formulation", default=None, metavar="NAME",
                       help="efficiency (default: regression on each choice's efficiency), "
                            "log_efficiency, or lambdarank (each problem's choices ranked; "
                            "better within a device's problems, worse on a new workload: "
                            "docs/results.md)")
    train.add_argument("--threads", type=int, default=None, help="training threads (default 2)")
    train.set_defaults(func=_cmd_train)

    publish = sub.add_parser(
        "publish", help="publish WORKDIR/models/table/ to a registry, promoted if the gate "
                        "passes")
    publish.add_argument("--workdir", required=True)
    publish.add_argument("--registry", default="registry", help=REGISTRY_HELP)
    publish.add_argument("--model", required=True, help="the registry model name")
    publish.set_defaults(func=_cmd_publish)

    convert = sub.add_parser("convert", help="raw benchmark records (JSONL) or CK tile-engine "
                                             "CSVs -> parquet")
    convert.add_argument("inputs", nargs="+")
    convert.add_argument("--out", required=True)
    convert.add_argument("--from", dest="source", choices=("raw", "ck-csv"), default="raw",
                         help="input format: tilecast raw JSONL (default) or CK tile-engine CSV")
    convert.add_argument("--problem-set", default="train", choices=("train", "holdout"),
                         help="problem set of ck-csv rows (default train)")
    convert.set_defaults(func=_cmd_convert)

    from tilecast.table.formats import READERS

    imports = sub.add_parser(
        "import", help="other tools' measurements (Kernel Tuner, AutoHeuristic, CK tile-engine "
                       "CSVs, any table + mapping) -> a dataset directory",
        description="Read FILEs as --from's format, resolve each file's device in the hardware "
                    "table, and write DATASET_DIR (measurements.parquet + dataset.json) whole; "
                    "an existing dataset there gains the new rows (same columns). Bad input "
                    "writes nothing.")
    imports.add_argument("inputs", nargs="+", metavar="FILE")
    imports.add_argument("--from", dest="source", required=True, choices=tuple(READERS),
                         help="the files' format")
    imports.add_argument("--mapping", metavar="MAP.yaml",
                         help="--from table: which columns are problem, config, time (unit), "
                              "device, status")
    imports.add_argument("--device", metavar="NAME",
                         help="the device of files that name none (CK CSVs, AutoHeuristic, "
                              "an empty Kernel Tuner device_name)")
    imports.add_argument("--devices", action="append", default=[], metavar="DEVICES.yaml",
                         help="a hardware table adding to the shipped devices (repeatable)")
    imports.add_argument("--out", required=True, metavar="DATASET_DIR")
    imports.set_defaults(func=_cmd_import)

    evaluate = sub.add_parser(
        "evaluate", help="measure the oracle on your own problems and score the published "
                         "model's choices on them (--model), or evaluate a table model across "
                         "the devices of an imported dataset (--dataset)",
        description="Two modes. --model M --problems FILE: measure every candidate of the "
                    "published model on the problems and score its choices. --dataset DIR: "
                    "hold each device of an imported dataset out in turn, train on the others "
                    "and score the picks against the held-out measurements and the baselines; "
                    "writes WORKDIR/report/transfer.json and transfer.md.")
    evaluate.add_argument("--registry", default=None, help=REGISTRY_HELP + " (--model mode)")
    evaluate.add_argument("--model")
    evaluate.add_argument("--alias", default=None,
                          help="alias or version number (default production)")
    evaluate.add_argument("--problems",
                          help="YAML/JSON file: 'problems:' + list / grid / random entries")
    evaluate.add_argument("--workdir", required=True)
    evaluate.add_argument("--config", default=None,
                          help="config whose measurement protocol is used (default quick)")
    evaluate.add_argument("--dataset", help="an imported dataset directory (tilecast import)")
    evaluate.add_argument("--split", help="leave-one-device-out (default): each device held "
                                          "out in turn; problems: problem folds held out on "
                                          "every device; sources: each imported file's "
                                          "problems held out in turn (an unseen workload)")
    evaluate.add_argument("--devices", action="append", default=None, metavar="DEVICES.yaml",
                          help="a hardware table adding to or replacing the shipped devices "
                               "(repeatable)")
    evaluate.add_argument("--rounds", type=int, help="boosting rounds (default 300)")
    evaluate.add_argument("--formulation", default=None, metavar="NAME",
                          help="the model's formulation, as tilecast train --formulation")
    evaluate.add_argument("--default", dest="default_config", metavar="KEY",
                          help="a configuration to report as the 'default' baseline "
                               "(e.g. a vendor library's choice), as name=value,...")
    evaluate.add_argument("--threads", type=int, help="training threads (default: all)")
    evaluate.set_defaults(func=_cmd_evaluate)

    repeat = sub.add_parser(
        "repeatability", help="how well two runs of one config agree: one run's winners "
                              "scored on the other, per problem set and runtime bin",
        description="Each run is a workdir (its data/<family>.parquet) or a converted parquet "
                    "file. Prints, both ways, the mean / P10 / min efficiency of one run's "
                    "winners measured in the other, the share of winners in the other's "
                    "practical-tie set and within 2 %% of its best: the ceiling any model's "
                    "figures are judged under.")
    repeat.add_argument("runs", nargs=2, metavar="RUN")
    repeat.add_argument("--family", default="gemm")
    repeat.add_argument("--tie-threshold-pct", type=float, default=1.0)
    repeat.add_argument("--nights", type=int, default=None,
                        help="two stores: print K = 1 .. this many nights (default: all both have)")
    repeat.add_argument("--hardware-class", default=None,
                        help="two stores: the class to compare (default: the one both hold)")
    repeat.set_defaults(func=_cmd_repeatability)

    store = sub.add_parser(
        "store", help="a measurement store: what it holds, whether it is sound, or add "
                      "workdirs' nights to it",
        description="A store (a directory or s3:// prefix) keeps every record of every night "
                    "`tilecast run --store S` measured, per hardware class. summary: per class, "
                    "nights, problems, kernels, records and the last night. check: lists "
                    "damaged, foreign or left-over files (exit status 1 when there are any). "
                    "add: the records of existing workdirs become nights of the store.")
    store.add_argument("action", choices=("summary", "check", "add"))
    store.add_argument("store", metavar="STORE", help="a directory or fsspec URL (s3://...)")
    store.add_argument("workdirs", nargs="*", metavar="WORKDIR", help="add: workdirs of runs")
    store.add_argument("--hardware-class", default=None,
                       help="add: the class of workdirs measured on another machine")
    store.set_defaults(func=_cmd_store)

    plan = sub.add_parser(
        "plan", help="what a budgeted night with a store would measure tonight, and why",
        description="The plan `tilecast run --store S` makes on a config with "
                    "night.budget_minutes (tilecast.store.plan): labels to settle, drift "
                    "sentinels, then new shapes where the model's members disagree most. "
                    "Nothing is built or measured.")
    plan.add_argument("--store", required=True, help="a directory or fsspec URL (s3://...)")
    plan.add_argument("--config", default="nightly")
    plan.add_argument("--family", default=None, help="one family (default: every one)")
    plan.add_argument("--budget-minutes", type=float, default=None,
                      help="default: the config's night.budget_minutes")
    plan.add_argument("--show", type=int, default=20, help="problems listed (default 20)")
    plan.set_defaults(func=_cmd_plan)

    replays = sub.add_parser(
        "replay", help="compare how nights choose new shapes over a store, measuring nothing",
        description="The store's training shapes of one class are what a night could measure "
                    "and their pooled labels what measuring gives; each policy starts from the "
                    "same random shapes, adds --step shapes --steps times as a night would "
                    "choose them, and its model is scored on the config's held-out shapes "
                    "after each step (medians over --seeds seeds).")
    replays.add_argument("store", metavar="STORE")
    replays.add_argument("--config", default="nightly")
    replays.add_argument("--family", default="gemm")
    replays.add_argument("--policies", nargs="+", default=["active", "regret", "random"],
                         choices=["active", "regret", "random"],
                         help="active: as a budgeted night (the workload file's share, then "
                              "the members' regret); regret: the members' regret alone; "
                              "random: random shapes (default: all three)")
    replays.add_argument("--hardware-class", default=None,
                         help="default: this host's class, else the one class the store holds")
    replays.add_argument("--start", type=int, default=40)
    replays.add_argument("--step", type=int, default=20)
    replays.add_argument("--steps", type=int, default=8)
    replays.add_argument("--seeds", type=int, default=3)
    replays.add_argument("--rounds", type=int, default=500, help="trees of each model")
    replays.add_argument("--out", default=None, help="also write every point as JSON here")
    replays.set_defaults(func=_cmd_replay)

    reg = sub.add_parser("registry", help="list, show, promote or roll back model versions")
    reg.add_argument("action", choices=("list", "show", "promote", "rollback"))
    reg.add_argument("model", nargs="?", help="model name (all models for list)")
    reg.add_argument("version", nargs="?", help="version number (show, promote)")
    reg.add_argument("--registry", default="registry", help=REGISTRY_HELP)
    reg.add_argument("--alias", default="production",
                     help="alias to show, move or roll back (default production)")
    reg.set_defaults(func=_cmd_registry)

    rebench = sub.add_parser(
        "rebench", help="re-measure the sentinel problems with every kernel and report "
                        "regressions against the previous rebenchmark",
        description="Build every candidate kernel of the config, measure it on each family's "
                    "sentinel problems, store the run in the history and compare it with the "
                    "previous run there. Writes WORKDIR/report/rebench_<family>.json and "
                    "WORKDIR/report/rebench.md; prints the markdown.",
        epilog=REBENCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    rebench.add_argument("--config", default="quick", help=CONFIG_HELP)
    rebench.add_argument("--workdir", required=True)
    rebench.add_argument("--history", required=True,
                         help="directory of past rebenchmarks (<family>/<run_id>.jsonl, latest.json)")
    rebench.add_argument("--families", default=None,
                         help="comma-separated families (default: every family of the config)")
    rebench.add_argument("--problems", nargs="+", default=None, metavar="P",
                         help="only these sentinel problems: dims keys or 'm=40,n=70,k=90'")
    rebench.add_argument("--git-ref", default=None,
                         help="build the kernels from this commit instead of the working tree")
    rebench.add_argument("--repo", default=None,
                         help="repository of --git-ref (default: this project's)")
    rebench.add_argument("--alpha", type=float, default=0.01,
                         help="false discovery rate of the tests (default 0.01)")
    rebench.add_argument("--min-effect", type=float, default=0.05,
                         help="smallest change that counts, as a fraction (default 0.05 = 5%%)")
    rebench.add_argument("--samples", type=int, default=None,
                         help="samples per kernel and problem (default: the protocol's, raised "
                              "to what the tests need)")
    rebench.set_defaults(func=_cmd_rebench)

    config = sub.add_parser("config", help="check a run config without running anything, or "
                                           "print the JSON Schema configs follow")
    actions = config.add_subparsers(dest="action", metavar="{check,schema}", required=True)
    check = actions.add_parser("check", help="validate FILE: 'ok: ...' and a one-line summary, "
                                             "or the first error (exit status 2)")
    check.add_argument("file", metavar="FILE", help=CONFIG_HELP)
    check.set_defaults(func=_cmd_config_check)
    schema = actions.add_parser("schema", help="print the JSON Schema of a run config")
    schema.set_defaults(func=_cmd_config_schema)
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Run one command; a user error (USER_ERRORS) is one line on stderr and exit status 2."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)
    for chatty in ("httpx", "httpcore"):  # one line per API call of the embedded server
        logging.getLogger(chatty).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except user_errors() as err:  # the tuple is made only when an error arrives here
        log.debug("the error's traceback (a user error: shown with --verbose only)",
                  exc_info=True)
        print(f"tilecast {args.command}: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader of stdout left (`tilecast config schema | head`): no traceback, and no
        # second one when Python flushes stdout at exit; the status a shell gives SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())

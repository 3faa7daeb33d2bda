"""`tilecast registry`: list, show, promote or roll back a registry's model versions;
`tilecast prebuild`: a version again with this host's kernel libraries, to serve without a
compiler."""
from __future__ import annotations

import json

from tilecast.cli.errors import CliError
from tilecast.cli.options import REGISTRY_HELP, add_command
from tilecast.cli.paths import registry_root


def add_parser(subparsers) -> None:
    """Add `registry`."""
    reg = add_command(subparsers, "registry",
                      help="list, show, promote or roll back model versions")
    reg.add_argument("action", choices=("list", "show", "promote", "rollback"))
    reg.add_argument("model", nargs="?", help="model name (all models for list)")
    reg.add_argument("version", nargs="?", help="version number (show, promote)")
    reg.add_argument("--registry", default="registry", help=REGISTRY_HELP)
    reg.add_argument("--alias", default="production",
                     help="alias to show, move or roll back (default production)")
    reg.set_defaults(func=_cmd_registry)

    pre = add_command(subparsers, "prebuild",
                      help="publish a version again with this host's kernel libraries, so "
                           "that hosts like it serve its kernels without a compiler")
    pre.add_argument("--model", required=True,
                     help="model name (without '@<class>': this host's hardware class)")
    which = pre.add_mutually_exclusive_group()
    which.add_argument("--version", dest="model_version", metavar="N",
                       help="the version to prebuild (default: the alias's)")
    which.add_argument("--alias", default="production",
                       help="the alias whose version to prebuild (default production)")
    pre.add_argument("--registry", default="registry", help=REGISTRY_HELP)
    pre.add_argument("--jobs", type=int, default=2, help="parallel compiles (default 2)")
    pre.set_defaults(func=_cmd_prebuild)


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


def _cmd_prebuild(args) -> int:
    from tilecast.core.settings import settings
    from tilecast.runtime.prebuild import prebuild

    if args.jobs < 1:
        raise CliError(f"--jobs {args.jobs} must be at least 1")
    root = registry_root(args.registry)
    model = _class_to_move(root, args.model)
    try:
        done = prebuild(root, model, args.model_version or args.alias,
                        compiler=settings().compiler, jobs=args.jobs)
    except PermissionError as err:
        raise CliError(f"registry {root} is not writable: {err.strerror} ({err.filename}); "
                       "ask its owner, or use a registry you can write") from None
    size = f"{done.libraries} libraries, {done.bytes / 2**20:.1f} MiB"
    if not done.published:
        print(f"{model}: version {done.version} already carries kernels this host runs "
              f"({done.tag}: {size}); nothing published")
        return 0
    moved = ", ".join(f"{alias} -> {done.version}" for alias in done.aliases) or "none"
    print(f"{model}: version {done.version} = version {done.source_version} with prebuilt "
          f"kernels for {done.tag} ({size}; {done.cached} from the caches, "
          f"{done.libraries - done.cached} compiled); aliases moved: {moved}")
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


"""`tilecast store`, `plan` and `replay`: a measurement store's nights, what a budgeted night
would measure, and how ways of choosing new shapes compare over a store's labels."""
from __future__ import annotations

from tilecast.cli.errors import CliError
from tilecast.cli.options import add_command
from tilecast.cli.paths import config_arg, user_dir


def add_parser(subparsers) -> None:
    """Add `store`, `plan` and `replay`."""
    store = add_command(
        subparsers, "store", help="a measurement store: what it holds, whether it is sound, or "
                                  "add workdirs' nights to it",
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

    plan = add_command(
        subparsers, "plan", help="what a budgeted night with a store would measure tonight, "
                                 "and why",
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
    _add_replay(subparsers)


def _add_replay(subparsers) -> None:
    replays = add_command(
        subparsers, "replay",
        help="compare how nights choose new shapes over a store, measuring nothing",
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


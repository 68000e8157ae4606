"""The command line of every script: tyro parses it (and writes --help), and input it rejects is reported as ONE line,
`error: ...` naming the bad value and what is allowed, exit code 2, instead of tyro's multi-line box.

Light on imports (no torch): the toolbox and list_envs.py use it too."""

import contextlib
import dataclasses
import difflib
import sys
import typing
from collections.abc import Sequence


class UsageError(Exception):
    """The one line a rejected command line prints after `error: `."""


def known_flags(args_class: type) -> list[str]:
    """The --flags tyro builds from a (flat or nested) dataclass: --name, and --no-name for a boolean."""
    flags = []

    def visit(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            kind = hints.get(field.name)
            if dataclasses.is_dataclass(kind):
                visit(kind, f"{prefix}{field.name}.")
                continue
            name = f"{prefix}{field.name}".replace("_", "-")
            flags.append(f"--{name}")
            if kind is bool:
                flags.append(f"--{prefix.replace('_', '-')}no-{field.name.replace('_', '-')}")

    if dataclasses.is_dataclass(args_class):
        visit(args_class, "")
    return flags + ["--help"]


def given_fields(argv: Sequence[str], args_class: type) -> set[str]:
    """The settings a command line sets explicitly (field names): --name, --name=value, --no-name."""
    names = {field.name for field in dataclasses.fields(args_class)} if dataclasses.is_dataclass(args_class) else set()
    given = set()
    for token in argv:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            given.add(name[3:] if name not in names and name.startswith("no_") else name)
    return given


def closest_flag(token: str, flags: Sequence[str]) -> str | None:
    """The known flag a mistyped one most likely meant (None: nothing close)."""
    name = token.split("=", 1)[0]
    # A part of a name (--feedback-mode for --teacher-feedback-mode): the shortest flag containing it, else a misspelling.
    containing = sorted((flag for flag in flags if len(name) > 5 and f"-{name[2:]}" in f"-{flag[2:]}"), key=len)
    if containing:
        return containing[0]
    close = difflib.get_close_matches(name, flags, n=1, cutoff=0.75)
    return close[0] if close else None


def unknown_flags_line(flags: Sequence[str], known: Sequence[str]) -> str:
    """The one line for flags a script does not have, each with the known flag it most likely meant."""
    named = []
    for flag in flags:
        guess = closest_flag(flag, known)
        named.append(f"{flag.split('=', 1)[0]}" + (f" (did you mean {guess}?)" if guess else ""))
    return f"unknown flag{'s' if len(named) > 1 else ''} {', '.join(named)}; see --help"


def refuse_unknown_flags(script: str, argv: Sequence[str] | None = None) -> None:
    """Before a script's heavy imports (torch takes seconds on a busy machine): a flag its Args does not have, read from
    its source (args_source), is refused as tyro's parse would refuse it, in one line with exit code 2. Everything else
    (values, combinations) is checked by the parse and the script's validation after the imports."""
    from .args_source import source_flags

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = seed_spellings(argv)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    known = source_flags(script)
    if known is None:  # not readable from source: tyro's parse decides
        return
    known += ["--help", "-h"]
    unknown = [token for token in argv if token.startswith("--") and token.split("=", 1)[0].replace("_", "-") not in known]
    if unknown:
        print(f"error: {unknown_flags_line(unknown, known)}", file=sys.stderr)
        sys.exit(2)


def given_value(argv: Sequence[str], names: Sequence[str]) -> str | None:
    """The value the command line gave a flag (`--flag value` or `--flag=value`, `_` or `-` between words as tyro
    takes them; the last one wins)."""
    value = None
    for i, token in enumerate(argv):
        flag, equals, rest = token.partition("=")
        if flag in names or (flag.startswith("--") and "--" + flag[2:].replace("_", "-") in names):
            value = rest if equals else (argv[i + 1] if i + 1 < len(argv) else None)
    return value


def seed_spellings(argv: Sequence[str]) -> list[str]:
    """A command line with the seed project's spellings (its README's commands) in today's: `--exploration-load
    --path-to-model models/<run>/<step>/checkpoint.pt --path-to-replay-buffer models/<run>/<step>/replay_buffer.npz`
    is `--exploration-from models/<run>/<step>` (a run keeps both files in one folder; the seed's .pth names find it
    too), and `--feedback-server-url host:port` is http://host:port. UsageError where the spelling is incomplete."""
    from pathlib import Path

    argv = list(argv)
    paths = {name: given_value(argv, [name]) for name in ("--path-to-model", "--path-to-replay-buffer")}
    if "--exploration-load" in argv:  # (evaluation.py's own --path-to-model is left alone)
        if None in paths.values():
            raise UsageError(
                "--exploration-load, --path-to-model and --path-to-replay-buffer come together (the seed's spelling); "
                "today: --exploration-from models/<run>/<step>"
            )
        folders = {name: Path(path) if Path(path).is_dir() else Path(path).parent for name, path in paths.items()}
        if len(set(folders.values())) > 1:
            raise UsageError(
                f"--path-to-model and --path-to-replay-buffer must be in one folder (a run saves both in "
                f"models/<run>/<step>), got {folders['--path-to-model']} and {folders['--path-to-replay-buffer']}"
            )
        kept, value_next = [], False
        for token in argv:
            flag = token.split("=", 1)[0].replace("_", "-")
            if not value_next and token != "--exploration-load" and flag not in paths:
                kept.append(token)
            value_next = flag in paths and "=" not in token
        argv = [*kept, "--exploration-from", str(folders["--path-to-model"])]
    url = given_value(argv, ["--feedback-server-url"])
    if url is not None and "://" not in url:
        at = max(i for i, token in enumerate(argv) if token.split("=", 1)[0] == "--feedback-server-url")
        argv[at : at + (1 if "=" in argv[at] else 2)] = ["--feedback-server-url", f"http://{url}"]
    return argv


def one_line(event, args_class: type, argv: Sequence[str]) -> str | None:
    """The one line of a tyro parse error (tyro._errors' events); None: an event these scripts cannot meet (tyro's own
    message then)."""
    from tyro import _errors

    if isinstance(event, _errors.UnrecognizedArgs):
        flags = [token for token in event.tokens if token.startswith("-")]
        if not flags:  # values with no flag before them, e.g. a value given to an on/off flag (--surf yes)
            listed = " ".join(repr(token) for token in event.tokens)
            return f"unexpected argument {listed}: every setting is a --flag (an on/off one takes no value: --x / --no-x); see --help"
        return unknown_flags_line(flags, known_flags(args_class))
    argument = getattr(event, "argument", None)
    flag = argument.display_name() if argument is not None else None
    if isinstance(event, _errors.InvalidChoice):
        return f"{flag} {event.value!r} is not one of: {', '.join(str(choice) for choice in event.choices)}"
    if isinstance(event, _errors.InstantiationFailure):
        if argument is None:
            return event.message.replace("\n", " ")
        value = given_value(argv, argument.lowered.name_or_flags)
        expected = argument.lowered.metavar or "another value"
        got = f"got {value!r}" if value is not None else event.message.replace("\n", " ")
        return f"{flag} expects {expected}, {got}"
    if isinstance(event, _errors.BadValue):
        if event.reason == "fixed":
            return f"{flag} takes no value, got {event.offending_value!r}"
        metavar = argument.lowered.metavar
        return f"{flag} needs a value ({metavar})" if metavar else f"{flag} needs a value"
    if isinstance(event, _errors.MissingArgs):
        names = [context.arg.display_name() for context in event.missing_arguments]
        return f"missing {', '.join(names)}; see --help"
    return None


def parse_args(args_class: type, args: Sequence[str] | None = None, default=None):
    """tyro.cli(args_class, args=args, default=default), with a rejected command line printed as one `error:` line on
    stderr and exit code 2. --help is tyro's, untouched."""
    import tyro

    argv = list(sys.argv[1:] if args is None else args)
    try:  # tyro's hook into its parse errors (tyro 1.0); where it is missing, tyro prints its own box
        from tyro._errors import on_parse_error
    except ImportError:
        on_parse_error = None

    def report(event) -> None:
        line = one_line(event, args_class, argv)
        if line is not None:
            raise UsageError(line)

    view = grouped_view(args_class, default)
    try:
        with on_parse_error(report) if on_parse_error is not None else contextlib.nullcontext():
            if view is None:
                return tyro.cli(args_class, args=argv, default=default)
            parsed = tyro.cli(view, args=argv)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    values = {name: value for group in dataclasses.fields(parsed) for name, value in vars(getattr(parsed, group.name)).items()}
    return args_class(**values)


def grouped_view(args_class: type, default=None) -> type | None:
    """The dataclass tyro parses a script's command line into, when its Args names `first_flags`: one nested dataclass
    per titled group of args_source.help_groups (the flags to set first, then each settings class's), every flag
    keeping its name (tyro.conf.OmitArgPrefixes), so that --help shows the groups under their titles. Defaults are
    `default`'s (else args_class's); parse_args turns the parse back into args_class. None: the flat Args is parsed as
    it is (no first_flags, or no source to read the groups from)."""
    import inspect
    import typing
    from pathlib import Path

    import tyro

    from .args_source import help_groups

    if not getattr(args_class, "first_flags", None):
        return None
    try:
        path = Path(inspect.getsourcefile(args_class)).resolve()
        groups = help_groups(path.parents[1], path, args_class.__name__)
    except (TypeError, OSError, SyntaxError, LookupError):
        return None
    hints = typing.get_type_hints(args_class, include_extras=True)
    default = default if default is not None else args_class()
    members = []
    for index, (title, description, fields) in enumerate(groups):
        group_fields = []
        for field in fields:
            annotation, value = hints[field.name], getattr(default, field.name)
            if typing.get_origin(annotation) is not typing.Annotated:
                annotation = typing.Annotated[annotation, tyro.conf.arg(help=field.doc)]
            group_fields.append((field.name, annotation, dataclasses.field(default_factory=lambda v=value: v)))
        group = dataclasses.make_dataclass(f"Group{index}", group_fields)
        group.__doc__ = description
        annotated = typing.Annotated[group, tyro.conf.OmitArgPrefixes, tyro.conf.arg(name=title)]
        members.append((f"group{index}", annotated, dataclasses.field(default_factory=group)))
    view = dataclasses.make_dataclass(args_class.__name__, members)
    view.__doc__ = args_class.__doc__
    return view

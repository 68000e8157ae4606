"""`python script.py --flags`: the command line read into the script's Args (one-line errors, the defaults of
presets.settings_defaults), the run started, and its failures turned into exit codes and a resume command."""

import shlex
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from .arguments import UsageError, parse_args, seed_spellings
from .errors import ConfigError
from .feedback import FeedbackServerError
from .presets import say_human_defaults, settings_defaults
from .run import RunInterrupted
from .stopping import stop_signals_handled, stopped_by
from .tracking import SECRET_ARGS


def script_name(args_class: type) -> str:
    """The file name of the script that defines args_class (sac_rlhf.py, also when it runs as __main__)."""
    module = sys.modules.get(args_class.__module__)
    return Path(getattr(module, "__file__", None) or f"{args_class.__module__}.py").name


def command_line_args(args_class: type, argv: list[str] | None = None):
    """The settings a command line (default: sys.argv[1:]) asks for: the seed project's spellings read as today's
    (arguments.seed_spellings), tyro's parse of it (its errors as one line) onto the defaults presets.settings_defaults
    stacks (the preset, the objective's needs, human mode's label budget), and the line saying what human mode sized."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = seed_spellings(argv)
        default, human_sized = settings_defaults(args_class, argv, script=script_name(args_class))
    except (UsageError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    args = parse_args(args_class, argv, default=default)
    # the feedback_schedule of the script that defines Args or one it builds on (a variant's Args extends sac_rlhf's)
    modules = (sys.modules.get(cls.__module__) for cls in args_class.__mro__)
    schedule = next((module.feedback_schedule for module in modules if hasattr(module, "feedback_schedule")), None)
    say_human_defaults(args, human_sized, schedule)
    return args


def resume_command(argv: list[str], checkpoint: Path) -> str:
    """The command line that continues an interrupted run: this one (script, flags) with --resume <checkpoint> in place
    of any earlier --resume, run from the same folder. Secret settings are left out (the line is printed, and may be
    logged): the resumed run takes the feedback server's token from FEEDBACK_SERVER_TOKEN, else from the run's
    runs/<run>/feedback_token (feedback.feedback_token), so its server keeps the token the run started with."""
    dropped = {"--resume", *(f"--{name.replace('_', '-')}" for name in SECRET_ARGS)}
    flags, skip = [], False
    for token in argv[1:]:
        name = token.split("=", 1)[0]
        if skip or (name.startswith("--") and name.replace("_", "-") in dropped):  # --feedback_server_token=X too
            skip = not skip and "=" not in token  # a flag without `=`: its value follows
            continue
        flags.append(token)
    on_path = shutil.which("python")  # `python` where it is this interpreter (an activated venv), else its full path
    python = "python" if on_path and Path(on_path).resolve() == Path(sys.executable).resolve() else sys.executable
    return shlex.join([python, argv[0], *flags, "--resume", str(checkpoint)])


def cli(args_class: type, main: Callable) -> None:
    """`python script.py --flags`: parse into args_class with tyro, run main, and map failures to exit codes:
    bad input 2 (one line on stderr, tyro's parse errors included), an unreachable or refusing feedback server 1,
    Ctrl-C 130, SIGTERM 143 (after the same checkpoint as Ctrl-C). SIGTERM (`kill`, SLURM's end of a job's time or a
    preemption, a container stopping) stops a run as Ctrl-C does, where the default would kill it on the spot: it
    saves models/<run>/latest at a step boundary, stops the feedback server it started and says how to resume
    (cleanrlhf_utils.stopping)."""
    args = command_line_args(args_class)
    try:
        with stop_signals_handled():
            main(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except FeedbackServerError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as interrupt:
        failure = getattr(interrupt, "failure", None)
        if failure is not None:
            print(f"error: {failure}", file=sys.stderr)
        if isinstance(interrupt, RunInterrupted):  # the run saved its checkpoint: say how to continue it
            print(f"to resume: {resume_command(sys.argv, interrupt.checkpoint)}", flush=True)
        sys.exit(1 if failure is not None else 128 + signal.SIGTERM if stopped_by() == signal.SIGTERM else 130)

"""One owner for the feedback protocol: the server serves exactly the routes cleanrlhf_utils.protocol names, the
trainer's client and the page call only those, and an installed (not editable) project starts the server, by its
entry point and by the trainer's autostart, from outside the checkout."""

import math
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

from cleanrlhf_utils import protocol
from cleanrlhf_utils.feedback import CHOICE_LABELS
from humanFeedback import feedback_server

REPO = Path(__file__).resolve().parents[1]

ROUTES = {name: value for name, value in vars(protocol).items() if name.isupper() and isinstance(value, str) and value.startswith("/")}


def test_the_server_serves_exactly_the_protocols_routes(tmp_path):
    app = feedback_server.create_app(tmp_path)
    served = {rule.rule for rule in app.url_map.iter_rules()}
    assert served == set(ROUTES.values())


def test_path_fills_a_route_and_refuses_missing_or_extra_values():
    assert protocol.path(protocol.RUN_ANSWERS, run_id=3) == "/api/runs/3/answers"
    assert protocol.path(protocol.CLIP, run_id=1, name="a.mp4") == "/clips/1/a.mp4"
    assert protocol.path(protocol.CONFIG) == "/api/config"
    with pytest.raises(TypeError, match="takes run_id; got query_id"):
        protocol.path(protocol.RUN_QUERIES, query_id=3)
    with pytest.raises(TypeError, match="takes no values; got run_id"):
        protocol.path(protocol.RUNS, run_id=3)


def test_a_persons_answer_means_what_the_synthetic_teachers_label_means(tmp_path):
    """The page shows segment 0 on the left: a person's `left` is the label the synthetic teacher gives a pair whose
    segment 0 has the higher return, `right` one whose segment 1 has, `tie` equal returns, and `skip` no label; and
    the server takes exactly the protocol's choices, each answer reaching the trainer as the choice it stored."""
    import numpy as np
    from test_feedback_server import Env

    from cleanrlhf_utils.feedback import SyntheticTeacher

    returns = np.array([[[1.0], [0.0]], [[0.0], [1.0]], [[0.5], [0.5]]])  # segment 0 better, segment 1 better, equal
    synthetic = SyntheticTeacher(-1.0, 1.0, 0.0, 0.0, 0.0, seed=0).label_true_rewards(returns)
    assert [CHOICE_LABELS[choice] for choice in ("left", "right", "tie")] == synthetic.tolist() == [0.0, 1.0, 0.5]
    assert math.isnan(CHOICE_LABELS["skip"]) and set(CHOICE_LABELS) == set(protocol.CHOICES)

    env = Env(tmp_path)
    run_id = env.run()
    query_ids = env.queries(run_id, n=len(protocol.CHOICES) + 1)
    for query_id, choice in zip(query_ids, protocol.CHOICES):
        assert env.label(query_id, choice).status_code == 201, choice
    assert env.label(query_ids[-1], "middle").status_code == 400  # not a choice of the protocol
    answers = {answer["query_id"]: answer["choice"] for answer in env.answers(run_id)["answers"]}
    assert answers == dict(zip(query_ids, protocol.CHOICES))


def test_the_page_calls_only_protocol_routes():
    script = (REPO / "humanFeedback/static/js/api.js").read_text()
    called = re.findall(r'["`](/api/[^"`?]*)', script)
    assert len(called) >= 6
    patterns = [re.compile("^" + re.sub(r"<(?:\w+:)?\w+>", r"[^/]+", rule) + "$") for rule in ROUTES.values()]
    for url in called:
        url = re.sub(r"\$\{[^}]*\}", "X", url)  # a template literal's ${...} fills a route variable
        assert any(p.match(url) for p in patterns), url
    assert protocol.TOKEN_HEADER not in script  # the page holds no token: its browser sends the session cookie


def test_no_protocol_literal_is_written_outside_its_owner():
    """The header, the token's variable and the routes are string literals only in protocol.py (and the page's api.js)."""
    for path in [REPO / "framework/cleanrlhf_utils/feedback.py", *sorted((REPO / "humanFeedback").glob("*.py"))]:
        code = path.read_text()
        for literal in (protocol.TOKEN_HEADER, protocol.TOKEN_ENV, protocol.SESSION_COOKIE):
            assert f'"{literal}"' not in code, (path, literal)
        assert not re.search(r'["\'](/api/|/clips/|/static/)', code), path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, token_file: Path, seconds: float = 30.0) -> bytes:
    """The body at `url`, asked with the token the server keeps in `token_file` once it is there."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            token = token_file.read_text().strip()
            with urllib.request.urlopen(urllib.request.Request(url, headers={protocol.TOKEN_HEADER: token}), timeout=2) as response:
                return response.read()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def site_packages_of_this_interpreter() -> list[str]:
    """Where the interpreter running the tests finds its packages: a venv's own site-packages when the suite runs in
    one (as the README's install does), the system's otherwise."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def copy_of_the_tracked_files(folder: Path) -> Path:
    """The files git tracks in this checkout, copied to `folder`: what a clean clone builds from. Never the
    checkout's .venv (gigabytes in the README's install), runs or caches."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60).stdout
    for name in filter(None, listed.decode().split("\0")):
        source, target = REPO / name, folder / name
        if source.is_file():  # a file deleted in the working tree but not yet in git is skipped
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return folder


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the project installed (not editable); its dependencies, pip and setuptools come from this
    interpreter's site-packages, so only the project itself is installed and nothing is downloaded. `venv
    --system-site-packages` would not do: from inside a venv it reaches the base Python's packages, not this venv's
    (an old setuptools there, and none of the dependencies). The directories are put on the path plainly, without
    running their .pth files, so the checkout's editable install stays out of the new venv."""
    root = tmp_path_factory.mktemp("installed")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    venv_site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    (Path(venv_site) / "this_interpreters_packages.pth").write_text("\n".join(site_packages_of_this_interpreter()) + "\n")
    build = copy_of_the_tracked_files(root / "build")
    result = subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q", str(build)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    shutil.rmtree(build)  # from here on, nothing of a checkout but this test's own REPO, which the venv must not use
    return venv


def run_outside(venv: Path, code: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", protocol.TOKEN_ENV)} | env
    return subprocess.run([venv / "bin/python", "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120, env=environment)


def test_the_installed_package_is_imported_from_the_venv_not_the_checkout(installed, tmp_path):
    result = run_outside(
        installed, "import humanFeedback, cleanrlhf_utils; print(humanFeedback.__file__, cleanrlhf_utils.__file__)", tmp_path
    )
    assert result.returncode == 0, result.stderr
    for location in result.stdout.split():
        assert str(installed) in location and str(REPO) not in location


def test_the_installed_venv_takes_its_dependencies_and_build_tools_from_this_interpreter(installed, tmp_path):
    """Only the project is new in the venv: setuptools (which built it) and the dependencies are those the suite runs
    with, wherever that is (a venv of its own or the system's Python)."""
    result = run_outside(installed, "import setuptools, flask, numpy; print(setuptools.__file__, flask.__file__, numpy.__file__)", tmp_path)
    assert result.returncode == 0, result.stderr
    import flask
    import numpy
    import setuptools

    assert result.stdout.split() == [setuptools.__file__, flask.__file__, numpy.__file__]


def test_the_installed_entry_point_serves_the_page_and_its_modules(installed, tmp_path):
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [installed / "bin/cleanrlhf-feedback-server", "--port", str(port), "--data-dir", str(tmp_path / "data")],
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        base, token_file = f"http://127.0.0.1:{port}", tmp_path / "data" / "token"  # the token it made itself
        assert b'"choices"' in wait_for(base + protocol.CONFIG, token_file)
        page = wait_for(base + "/", token_file).decode()
        assert '<script type="module" src="/static/js/main.js">' in page
        assert b"import" in wait_for(base + protocol.path(protocol.PAGE_SCRIPT, name="main.js"), token_file)
        assert (tmp_path / "data" / "feedback.sqlite3").exists()  # schema.sql shipped with the package
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_trainers_autostart_works_from_an_installed_package_outside_the_checkout(installed, tmp_path):
    port = free_port()
    code = f"""
from pathlib import Path
from cleanrlhf_utils.feedback import FeedbackClient, start_feedback_server
process = start_feedback_server("http://127.0.0.1:{port}", Path("server.log"), token="s3cret", data_dir=Path("data"))
try:
    client = FeedbackClient("http://127.0.0.1:{port}", "s3cret", retry_seconds=5)
    print("run", client.create_run("outside", "Hopper-v5", {{}}))
finally:
    process.terminate()
    process.wait(timeout=30)
"""
    result = run_outside(installed, code, tmp_path)
    assert result.returncode == 0, result.stderr + (tmp_path / "server.log").read_text()
    assert result.stdout.split() == ["run", "1"]
    assert "s3cret" not in (tmp_path / "server.log").read_text()

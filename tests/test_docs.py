"""The README and the docs site stay true: generated pages current (and the check able to see a stale one), the site
builds strictly, the README short, no page naming work items, and every command a page shows either run by a test or
marked as long."""

import importlib.util
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import sac_rlhf
import sac_rlhf_rime

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gen_docs", REPO / "dev" / "gen_docs.py")
gen_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_docs)

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LONG_MARKER = "<!-- long -->"


# ------------------------------------------------------------------------------------------------------------------
# Generated pages
# ------------------------------------------------------------------------------------------------------------------
def test_generated_pages_are_current():
    assert gen_docs.stale(REPO) == [], "regenerate with: python dev/gen_docs.py"


def project_copy(tmp_path: Path) -> Path:
    """What the generator reads and writes, copied, so a test can change a source without touching the checkout."""
    copy = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for folder in ("framework", "bench/results", "docs", "policies"):
        shutil.copytree(REPO / folder, copy / folder, ignore=ignore)
    shutil.copy(REPO / "README.md", copy / "README.md")
    return copy


def test_the_check_names_a_page_made_stale_by_a_docstring_or_a_result(tmp_path, capsys):
    copy = project_copy(tmp_path)  # current, as test_generated_pages_are_current checks of the checkout
    # A field's docstring changes (as when someone edits a flag's help): its flag pages are stale, and the CLI says which.
    source = copy / "framework" / "sac_rlhf.py"
    text = source.read_text()
    assert '"""total environment steps"""' in text
    source.write_text(text.replace('"""total environment steps"""', '"""environment steps of the whole run"""'))
    assert gen_docs.main(["--check", "--repo", str(copy)]) == 1
    found = [line.split()[1] for line in capsys.readouterr().err.splitlines() if line.startswith("stale: ")]
    assert "docs/reference/flags-sac_rlhf.md" in found
    assert "docs/reference/flags-pref_ppo.md" not in found and "docs/reference/flags-sac.md" not in found  # sac.py: its own copy
    # A results file changes: the benchmark page, the README's table and the file's plot are stale; a plot that is gone
    # is named.
    result = copy / "bench" / "results" / "feedback_efficiency" / "walker-walk" / "qpa-seed3.json"
    result.write_text(result.read_text().replace('"seed": 3', '"seed": 33', 1))
    images = copy / "docs" / "benchmarks" / "img"
    (images / "walker-walk" / "pebble.png").unlink()
    found = gen_docs.stale(copy)
    plots = {"docs/benchmarks/img/walker-walk/qpa-seed3.png", "docs/benchmarks/img/walker-walk/pebble.png"}
    assert {"docs/benchmarks/feedback-efficiency.md", *plots} <= set(found)
    assert not [path for path in found if path.endswith(".png") and path not in plots], "the other plots are current"
    # Regenerating writes what was stale and nothing else (test_generated_pages_are_current shows that generated pages
    # then match): the two plots are redrawn, with the fingerprints of what they show now, and nothing is stale after.
    before = {path: path.stat().st_mtime_ns for path in images.rglob("*.png")}
    assert gen_docs.main(["--repo", str(copy)]) == 0
    assert "environment steps of the whole run" in (copy / "docs/reference/flags-sac_rlhf.md").read_text()
    redrawn = {str(path.relative_to(copy)) for path in images.rglob("*.png") if path.stat().st_mtime_ns != before.get(path)}
    assert redrawn == plots and gen_docs.stale(copy) == []


def test_a_policy_shipped_without_its_gif_makes_the_readme_gallery_stale(tmp_path):
    """A policy added to policies/manifest.json: the README's gallery lacks it until regenerated (the check of every
    page, which takes minutes here, is test_generated_pages_are_current's), its GIF is missing until toolbox/gallery.py
    makes it, the gallery shows its title and labels, and a bad caption stops the generator."""
    copy = project_copy(tmp_path)
    path = copy / "policies" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["walker-pebble.pt"] = manifest["halfcheetah-pebble.pt"] | {"behaviour": "Walker2d walking", "labels": 200}
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    assert gen_docs.missing_gifs(copy) == ["docs/gallery/walker-pebble.gif"]  # what stale() adds to the pages it names
    shown = (copy / "README.md").read_text().split(gen_docs.GALLERY_START)[1].split(gen_docs.GALLERY_END)[0]
    gallery = gen_docs.gallery(gen_docs.shipped_policies(copy))
    assert shown != "\n" + gallery and "walker-pebble" not in shown  # generate() puts `gallery` there: README.md is stale
    cell = gallery.split('<img src="docs/gallery/walker-pebble.gif"')[1].split("</td>")[0]
    assert cell.endswith("<b>Walker2d walking</b><br>preferences of the synthetic teacher, 200 labels")
    manifest["walker-pebble.pt"]["taught_by"] = "a-crowd"
    path.write_text(json.dumps(manifest))
    with pytest.raises(SystemExit, match=r"walker-pebble\.pt: taught_by 'a-crowd' is not one of: synthetic-teacher, "):
        gen_docs.shipped_policies(copy)


def edit_manifest(copy: Path, edit) -> None:
    """Rewrites the copy's bench/results/manifest.yaml after `edit` changed its parsed content."""
    path = copy / "bench" / "results" / "manifest.yaml"
    data = yaml.safe_load(path.read_text())
    edit(data["results"])
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def suite_row(text: str, task: str) -> list[str]:
    """The cells of the suite table's rows for `task`, between the results markers of a page."""
    table = text.split(gen_docs.README_START, 1)[1].split(gen_docs.README_END, 1)[0]
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in table.splitlines() if line.startswith(f"| {task} |")]


def test_the_suite_table_pools_the_results_the_manifest_feeds_it_by_task_and_setting(tmp_path):
    """A suite row is every result with `suite` among its feeds that shares its task and setting: a file left out of
    the suite takes its seeds out of the row, and a file given another setting becomes a row of its own."""
    copy = project_copy(tmp_path)
    (walker_walk,) = suite_row(gen_docs.generate(copy)[0]["README.md"], "dm_control/walker-walk-v0")
    assert walker_walk[4] == "3" and walker_walk[6] == "[results](docs/benchmarks/feedback-efficiency.md#walker-walk-qpa)"

    def edit(results: dict) -> None:
        results["walker-walk/qpa-seed3"]["feeds"].remove("suite")
        results["hopper/pebble-seeds45"]["setting"] = "PEBBLE, exponential schedule, seeds 4 and 5"

    edit_manifest(copy, edit)
    readme = gen_docs.generate(copy)[0]["README.md"]
    (walker_walk,) = suite_row(readme, "dm_control/walker-walk-v0")
    two_seeds = statistics.median(
        row["ratio"] for row in json.loads((copy / "bench/results/feedback_efficiency/walker-walk/qpa.json").read_text())["rows"]
    )
    assert walker_walk[4] == "2" and walker_walk[5] == f"{two_seeds:.2f} × SAC"
    hopper = suite_row(readme, "Hopper-v5")
    assert [(row[1], row[4]) for row in hopper] == [
        ("PEBBLE, exponential schedule", "3"),
        ("PEBBLE, exponential schedule, seeds 4 and 5", "2"),
    ]
    assert hopper[1][6] == "[results](docs/benchmarks/feedback-efficiency.md#hopper-pebble-seeds45)"


def test_the_generator_stops_where_the_manifest_and_the_repository_disagree(tmp_path):
    """Each result is listed once with where it is shown: an unlisted results file, a table a page shows without the
    manifest saying so, a feed no table of the page takes, and a non-feedback result in the suite are named."""
    copy = project_copy(tmp_path)
    stray = copy / "bench" / "results" / "knn" / "speed" / "stray.json"
    stray.write_text("{}")

    def edit(results: dict) -> None:
        results["walker-walk/qpa"]["feeds"] = ["suite"]
        results["hopper/pebble-explore5k"]["feeds"] = ["docs/benchmarks/backflip.md"]
        results["speed/knn"]["feeds"] = ["suite"]
        results["objectives/windmill"]["feeds"] = []  # the README's summary table reads it

    edit_manifest(copy, edit)
    with pytest.raises(SystemExit) as stopped:
        gen_docs.generate(copy)
    message = str(stopped.value)
    assert "bench/results/knn/speed/stray.json: not in the manifest" in message
    assert re.search(r"walker-walk/qpa: docs/benchmarks/\S+\.md shows it, its feeds do not say so", message)
    assert "hopper/pebble-explore5k: feeds docs/benchmarks/backflip.md, whose table markers do not name it" in message
    assert "speed/knn: only feedback_efficiency results feed the suite" in message
    assert "objectives/windmill: README.md shows it, its feeds do not say so" in message
    with pytest.raises(SystemExit, match="stray.json: not in the manifest"):  # the check says it too, and fails
        gen_docs.main(["--check", "--repo", str(copy)])


def test_a_summary_table_reads_each_figure_from_the_rows_its_group_pools():
    """`<!-- table: summary name -->`: a manifest table whose cells hold `{group.value|statistic|format}` figures over
    the rows of the results a group pools (or their medians, filtered by `where`); a trailing % in the format shows
    the value × 100 with its unit, and its range without."""

    def row(seed: int, success: float, idle: float) -> dict:
        return {"seed": seed, "objective_success": success, "trainer_idle_share": idle}

    results = {
        "q/a": {"rows": [row(1, 0.995, 0.012), row(2, 0.1, 0.010), row(3, 0.5, 0.011)]},
        "q/b": {"rows": [row(4, 0.96, 0.02), row(5, 0.2, 0.03)]},
        "q/m": {
            "medians": [{"env": "Hopper-v5", "variant": "rime", "acc": 0.9312}, {"env": "Hopper-v5", "variant": "default", "acc": 0.799}]
        },
    }
    cells = [
        "{p.objective_success|median|.1f%} {p.objective_success|iqr|.0f%}, {p.objective_success|at_least 0.95} of {p.seed|distinct}",
        "seed 2: {p.objective_success|seed 2|.3f}; least {p.objective_success|min|.2f}; idle {p.trainer_idle_share|max|.1f%}",
        "{m.acc|median|.3f}",
    ]
    spec = {
        "columns": ["figures", "more", "medians"],
        "rows": [
            {"groups": {"p": ["q/a", "q/b"], "m": {"results": ["q/m"], "list": "medians", "where": {"variant": "rime"}}}, "cells": cells}
        ],
    }
    lines = gen_docs.summary_table(spec, results)
    assert lines[:2] == ["| figures | more | medians |", "|---|---|---|"]
    assert lines[2] == "| 50.0 % [20, 96], 2 of 5 | seed 2: 0.100; least 0.10; idle 3.0 % | 0.931 |"
    page = "<!-- table: summary t -->\n<!-- /table -->\n"
    manifest = gen_docs.Manifest({}, {}, {"t": spec})
    assert gen_docs.fill_tables(page, results, "page.md", manifest=manifest).splitlines()[3] == lines[2]
    assert gen_docs.marker_names(page, manifest.tables) == {"q/a", "q/b", "q/m"}
    with pytest.raises(SystemExit, match="summary table other"):
        gen_docs.fill_tables(page.replace(" t ", " other "), results, "page.md", manifest=manifest)


def test_flag_pages_list_every_field_of_the_scripts_args():
    """The parsed fields are the dataclasses' own: the same names, each once, as importing Args gives (in the titled
    groups of --help)."""
    import dataclasses

    import evaluation
    import sweep

    for name, module in (("sac_rlhf", sac_rlhf), ("evaluation", evaluation), ("sweep", sweep)):
        page = (REPO / f"docs/reference/flags-{name}.md").read_text()
        flags = re.findall(r"^\| `(--[a-z0-9-]+)`", page, re.M)
        assert sorted(flags) == sorted("--" + field.name.replace("_", "-") for field in dataclasses.fields(module.Args)), name


# ------------------------------------------------------------------------------------------------------------------
# The site builds strictly
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mkdocs() -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs and mkdocs-material are not installed here (the dev extra installs them)")


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300, env=env)


def test_site_builds_strictly(mkdocs, tmp_path):
    result = build(REPO, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_a_broken_internal_link_fails_the_build(mkdocs, tmp_path):
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "troubleshooting.md"
    page.write_text(page.read_text() + "\nSee [a page that is not there](no-such-page.md).\n")
    result = build(tmp_path, tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stdout + result.stderr


# ------------------------------------------------------------------------------------------------------------------
# The README and the pages
# ------------------------------------------------------------------------------------------------------------------
def test_readme_is_short_and_its_links_into_the_docs_exist():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\(((?:docs/|LICENSE)[^)#]*)", readme)
    assert links, "the README links into the docs"
    for link in links:
        assert (REPO / link).exists(), f"README.md links to {link}, which does not exist"


WORK_ITEM = re.compile(r"\bissues?\s*#?\d+|\bbefore the fix\b|\bafter the fix\b", re.I)
"""How a text names a work item or narrates a change (`issue 14`, `#26` as an issue, `before the fix`)"""
CODE = [path for folder in ("framework", "humanFeedback", "bench", "toolbox", "tests", "dev", "scripts", "slurm", "examples")
        for path in sorted((REPO / folder).rglob("*")) if path.suffix in (".py", ".sh", ".js", ".html", ".sql", ".yaml")
        and path != Path(__file__).resolve()]  # fmt: skip


def test_no_page_and_no_code_names_a_work_item():
    """Pages, code and tests speak of the project, not of its history."""
    for path in [*PAGES, *CODE]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not WORK_ITEM.search(line), f"{path.relative_to(REPO)}:{number}: {line.strip()}"


def test_the_work_item_check_sees_one():
    assert WORK_ITEM.search("a test for issue 14, item 8") and WORK_ITEM.search("Issue 26, part 4: ...")
    assert WORK_ITEM.search("the numbers before the fix") and not WORK_ITEM.search("the issues people report")


def bash_commands(text: str) -> list[tuple[str, bool]]:
    """Each command line of the page's ```bash blocks (continuations joined), and whether its block is marked long
    (the line before the opening fence is `<!-- long -->`). Blocks inside a longer fence (an example) are skipped."""
    commands = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        match = re.match(r"^(`{3,})(\w*)", lines[index])
        if not match:
            index += 1
            continue
        fence, language = match.groups()
        marked = index > 0 and lines[index - 1].strip() == LONG_MARKER
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith(fence) and lines[i].strip() == fence)
        if language == "bash" and len(fence) == 3:
            block = "\n".join(lines[index + 1 : end]).replace("\\\n", " ")
            commands += [(" ".join(line.split()), marked) for line in block.splitlines() if line.strip()]
        index = end + 1
    return commands


# Programs of this project a page may start: each such command must run in a test or be marked long.
PROGRAM = re.compile(r"^(?:\w+=\S+ )*(?:python (?:framework|bench|toolbox|humanFeedback|scripts|dev)/|bash (?:scripts|slurm|dev)/)")

# Commands the docs show unmarked, and the test that runs each (with small inputs and step counts).
RUN_BY_TESTS = {
    r"^python toolbox/labels\.py (list|agreement) ": "tests/test_labels_toolbox.py::test_kappa_on_pairs_labelled_by_two_people_equals_the_hand_computed_value",
    r"^python toolbox/labels\.py merge ": "tests/test_labels_toolbox.py::test_merge_never_duplicates_and_file_mode_reads_the_result",
    r"^python toolbox/labels\.py (export (?!.*--format imitation)|import )": (
        "tests/test_labels_toolbox.py::test_export_then_import_gives_identical_segments_and_labels"
    ),
    # imitation is not a dependency: the test runs the export where it is missing, and checks the one-line error
    r"^python toolbox/labels\.py export .*--format imitation": (
        "tests/test_labels_toolbox.py::test_imitation_export_says_what_it_needs_when_imitation_is_missing"
    ),
    r"^python framework/sac_rlhf\.py .*--teacher-feedback-mode file --feedback-file ": (
        "tests/test_human_feedback.py::test_human_mode_receives_exactly_the_labels_given_and_file_mode_reuses_them"
    ),
    r"^python toolbox/compare\.py ": "tests/test_toolbox.py::test_same_seed_same_report_through_the_cli",
    r"^python framework/evaluation\.py --path-to-model ": "tests/test_end_to_end.py::test_pebble_run_writes_scalars_checkpoint_and_feedback",
    r"^python toolbox/export_policy\.py ": "tests/test_policies.py::test_an_exported_checkpoint_evaluates_as_recorded",
    r"^python toolbox/filmstrip\.py ": "tests/test_policies.py::test_a_filmstrip_holds_the_frames_it_names",
    r"^python toolbox/gallery\.py --names ": (
        "tests/test_gallery.py::test_a_gif_holds_the_frames_its_settings_say_and_the_same_seed_gives_the_same_bytes"
    ),
    r"^python framework/sweep\.py --export-best ": "tests/test_sweep.py::test_optuna_sweep_stores_three_trials_and_exports_the_best",
    r"^bash dev/install_test_deps\.sh": "tests/test_newcomer.py::test_install_test_deps_installs_what_is_missing_once_and_says_so",
    r"^python dev/gen_docs\.py": "tests/test_docs.py::test_the_check_names_a_page_made_stale_by_a_docstring_or_a_result",
    r"^python framework/sac_rlhf\.py --env-id cleanrlhf_utils\.example_envs\.windmill:Windmill-v0 ": (
        "tests/test_custom_env.py::test_sac_rlhf_trains_on_the_windmill_with_an_objective"
    ),
}


def test_the_tests_named_for_commands_exist():
    for test in RUN_BY_TESTS.values():
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{test} does not exist"


def test_every_command_the_docs_show_runs_in_a_test_or_is_marked_long():
    unaccounted = []
    for page in PAGES:
        for command, marked in bash_commands(page.read_text()):
            if marked or not PROGRAM.match(command):
                continue
            if not any(re.search(pattern, command) for pattern in RUN_BY_TESTS):
                unaccounted.append(f"{page.relative_to(REPO)}: {command}")
    assert not unaccounted, (
        "commands neither run by a test (tests/test_docs.py RUN_BY_TESTS) nor marked long (<!-- long --> before the "
        "block):\n" + "\n".join(unaccounted)
    )


def test_the_command_check_sees_an_unmarked_long_command():
    page = "text\n\n```bash\npython framework/sac_rlhf.py --env-id Hopper-v5\n```\n"
    (command, marked) = bash_commands(page)[0]
    assert PROGRAM.match(command) and not marked
    assert not any(re.search(pattern, command) for pattern in RUN_BY_TESTS)
    assert bash_commands(page.replace("```bash", LONG_MARKER + "\n```bash")) == [(command, True)]


# The hand-written feature pages pick the main flags by topic; the generated reference is the complete list. A flag
# renamed or removed in the code must not live on in a hand-written table.
FEATURE_PAGES = {"pebble.md": "sac_rlhf", "human-feedback.md": "sac_rlhf", "pref-ppo.md": "pref_ppo"}


@pytest.mark.parametrize("page, script", FEATURE_PAGES.items())
def test_flags_in_the_feature_pages_tables_exist(page, script):
    reference = set(re.findall(r"`(--[a-z0-9-]+)`", (REPO / f"docs/reference/flags-{script}.md").read_text()))
    shown = set()
    for line in (REPO / "docs" / page).read_text().splitlines():
        if line.startswith("| `--"):
            shown |= set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", line.split("|")[1]))
    assert shown, page
    assert not shown - reference, f"docs/{page} shows flags that {script}.py does not have: {sorted(shown - reference)}"


def default_value(text: str):
    """A default as a hand-written table or the generated reference writes it (`on`, `1 000 000`, `3e-4`, `'disagree'`,
    `0 (off)`), as a comparable value; None where it is prose (`1/dt`, `terminates`, a path pattern)."""
    code_span = text.strip().startswith("`")
    text = re.sub(r"\s*\(.*\)$", "", text.strip().strip("`").replace("−", "-")).strip("`")
    if text in ("on", "True"):
        return True
    if text in ("off", "False"):
        return False
    try:
        return float(text.replace(" ", "").replace("_", ""))
    except ValueError:
        pass
    quoted = re.fullmatch(r"""['"]([^'"]*)['"]""", text)
    if quoted:
        return quoted.group(1)
    return text if code_span and re.fullmatch(r"[\w.:/-]+", text) and text != "None" else None


@pytest.mark.parametrize("page, script", FEATURE_PAGES.items())
def test_defaults_in_the_feature_pages_tables_are_the_codes(page, script):
    """A one-flag row's default (where it is a value, not prose) equals the code's, so a changed default in the code
    fails here until the hand-written table follows it."""
    reference = {}
    for line in (REPO / f"docs/reference/flags-{script}.md").read_text().splitlines():
        row = re.match(r"^\| `(--[a-z0-9-]+)`(?: / `--no-[a-z0-9-]+`)? \| .*? \| (.*?) \| ", line)
        if row:
            reference[row.group(1)] = default_value(row.group(2))
    compared = 0
    for line in (REPO / "docs" / page).read_text().splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if not line.startswith("| `--") or not re.fullmatch(r"`--[a-z0-9-]+`", cells[0]):
            continue
        flag = cells[0].strip("`")
        if flag not in reference and flag.startswith("--no-"):
            flag = "--" + flag.removeprefix("--no-")  # a row for --no-X gives X's default (on / off)
        shown, code = default_value(cells[1]), reference.get(flag)
        if shown is None or code is None:
            continue
        compared += 1
        assert shown == code, f"docs/{page}: {cells[0]} shows default {cells[1]!r}, the code has {code!r}"
    assert compared >= 3, page


def test_every_file_the_pages_name_in_scripts_dev_slurm_and_bench_exists():
    """Hand-written pages only: the generated ones quote the commands the results files recorded, as they ran. A path
    after `--output` is what a command will write, which a next experiment's command names before it has run."""
    generated = {REPO / gen_docs.FEEDBACK_PAGE, REPO / gen_docs.MEASUREMENTS_PAGE, *(REPO / "docs" / "reference").glob("*.md")}
    pattern = r"(?<![\w/])(?<!--output )((?:scripts|dev|slurm|bench|toolbox|framework|humanFeedback)/[\w./-]+\.(?:sh|py|json|yaml))"
    for page in PAGES:
        if page in generated:
            continue
        for path in set(re.findall(pattern, page.read_text())):
            assert (REPO / path).exists(), f"{page.relative_to(REPO)} names {path}, which does not exist"


def test_a_gap_table_shows_the_decomposition_with_medians_and_interquartile_ranges():
    """`<!-- table: gap <stem> -->` fills a page with bench/reward_gap.py's decomposition: per kind of run, the median
    return and ratio to SAC with their interquartile range over seeds, and the medians of what the runs measured."""
    spread = {"median": 0.8, "q25": 0.5, "q75": 1.0}
    entry = {"task": "dm_control/cheetah-run-v0", "kind": "frozen", "seeds": 3, "last_return_ratio": spread}
    entry |= {"final_eval_return": {"median": 300.0, "q25": 200.0, "q75": 350.0}, "final_eval_return_ratio": spread}
    entry |= {"reward_correlation": 0.87, "segment_correlation": None, "heldout_accuracy": 0.9, "learned_reward_std": 0.489}
    entry |= {"final_alpha": 0.025, "final_policy_entropy": -5.96}
    page = "before\n<!-- table: gap reward_gap_x -->\nold\n<!-- /table -->\nafter"
    filled = gen_docs.fill_tables(page, {"reward_gap_x": {"decomposition": [entry]}}, "page.md")
    row = filled.split("\n")[4]
    assert (
        row
        == "| dm\\_control/cheetah-run-v0 | frozen | 3 | 300 [200, 350] | 0.80 [0.50, 1.00] | 0.80 [0.50, 1.00] | 0.87 | – | 0.90 | 0.489 | 0.025 | -6.0 |"
    )
    assert filled.startswith("before\n<!-- table: gap reward_gap_x -->\n| task |") and filled.endswith("<!-- /table -->\nafter")


def test_a_noise_table_shows_each_defence_against_the_oracle_teacher_at_the_same_step():
    """`<!-- table: noise <stems> -->`: one block of rows per results file, named by its --robust-labels, each seed's
    return beside the oracle teacher's at the same step and their ratio, and a median row per defence."""

    def result(defence: str, returns: list[float]) -> dict:
        rows = [
            {"seed": seed, "pebble_return": value, "oracle_return": 1000.0, "oracle_ratio": value / 1000.0, "pebble_last_return": value,
             "oracle_last_return": 800.0, "oracle_last_ratio": value / 800.0, "heldout_accuracy": 0.9, "reward_correlation": 0.8}
            for seed, value in zip([1, 2, 3], returns)
        ]  # fmt: skip
        return {"settings": {"robust_labels": defence}, "rows": rows}

    results = {"none": result("none", [100.0, 500.0, 300.0]), "rime": result("rime", [900.0, 700.0, 800.0])}
    results["rime"]["settings"]["rime_warm_start_steps"] = 0
    # A result written with its seeds' spread shows the interquartile range beside each median ratio.
    results["rime"]["spread"] = {"oracle_ratio": {"median": 0.8, "q25": 0.75, "q75": 0.85}, "oracle_last_ratio": {"median": 1.0}}
    results["rime"]["spread"]["oracle_last_ratio"] |= {"q25": 0.9375, "q75": 1.0625}
    page = "<!-- table: noise none rime -->\n<!-- /table -->\n"
    lines = gen_docs.fill_tables(page, results, "page.md").splitlines()
    assert lines[3] == "| none | 1 | 100 | 1000 | 0.10 | 100 vs 800 | 0.12 | 0.90 | 0.80 |"
    assert lines[6] == "| **none, median** | | 300 | 1000 | **0.30** | 300 vs 800 | **0.38** | | |"
    # rime always says its warm start, so that a table reads the same whatever the scripts' default
    assert (
        lines[10] == "| **rime (no warm start), median** | | 800 | 1000 | **0.80** [0.75, 0.85] | 800 vs 800 | **1.00** [0.94, 1.06] | | |"
    )
    # rime with another flip threshold (--rime-flip-tau 1e-40: drop, never flip) is named apart from rime's defaults
    results["rime"]["settings"]["rime_flip_tau"] = 1e-40
    lines = gen_docs.fill_tables(page, results, "page.md").splitlines()
    assert lines[7].startswith("| rime (flip τ 1e-40, no warm start) | 1 | 900 |")
    assert lines[10].startswith("| **rime (flip τ 1e-40, no warm start), median** |")
    # a result written before the warm start was recorded ran with RIME's 1000 steps, the default then
    del results["rime"]["settings"]["rime_flip_tau"], results["rime"]["settings"]["rime_warm_start_steps"]
    lines = gen_docs.fill_tables(page, results, "page.md").splitlines()
    assert lines[7].startswith("| rime (warm start 1000 steps) | 1 | 900 |")


def test_a_noise_table_pools_the_files_of_one_defence_into_one_median_over_all_their_seeds():
    """Seeds of one defence run at different times (seeds 1-2, later seed 3) are one block: its rows by seed and one
    median row over the three, with their interquartile range when both files recorded a spread."""

    def result(seeds: list[int], ratios: list[float]) -> dict:
        rows = [
            {"seed": seed, "pebble_return": 1000 * ratio, "oracle_return": 1000.0, "oracle_ratio": ratio,
             "pebble_last_return": 800 * ratio, "oracle_last_return": 800.0, "oracle_last_ratio": ratio}
            for seed, ratio in zip(seeds, ratios)
        ]  # fmt: skip
        return {"settings": {"robust_labels": "none"}, "rows": rows, "spread": {}}

    results = {"late": result([3], [0.2]), "early": result([1, 2], [0.6, 0.4])}
    lines = gen_docs.noise_table([results["early"], results["late"]])
    assert [line.split(" | ")[:2] for line in lines[2:5]] == [["| none", "1"], ["| none", "2"], ["| none", "3"]]
    assert lines[5] == "| **none, median** | | 400 | 1000 | **0.40** [0.30, 0.50] | 320 vs 800 | **0.40** [0.30, 0.50] | | |"
    assert len(lines) == 6
    # Without a recorded spread in one of them (an older file), the median stands alone.
    del results["late"]["spread"]
    assert gen_docs.noise_table([results["early"], results["late"]])[5].split(" | ")[3] == "**0.40**"


def test_a_noise_table_takes_rimes_default_flip_threshold_from_the_script(tmp_path):
    """Which rime runs are named by their flip threshold follows sac_rlhf_rime.py's Args default, read from its source: with a
    script whose default is 0.01, a 0.01 run is plain `rime` and a 0.001 run is named apart."""
    (tmp_path / "framework").mkdir()
    script = 'class Args:\n    rime_flip_tau: float = 0.01\n    """doc"""\n    rime_warm_start_steps: int = 1000\n    """doc"""\n'
    (tmp_path / "framework" / "sac_rlhf_rime.py").write_text(script)
    assert gen_docs.args_default(tmp_path, "sac_rlhf_rime", "rime_flip_tau") == 0.01
    assert gen_docs.args_default(REPO, "sac_rlhf_rime", "rime_flip_tau") == sac_rlhf_rime.Args().rime_flip_tau
    row = {"seed": 1, "pebble_return": 1.0, "oracle_return": 2.0, "oracle_ratio": 0.5}
    names = []
    for flip_tau in (0.01, 0.001):
        result = {"settings": {"robust_labels": "rime", "rime_flip_tau": flip_tau}, "rows": [row]}
        names.append(gen_docs.noise_table([result], tmp_path)[2].split(" | ")[0])
    assert names == ["| rime (warm start 1000 steps)", "| rime (flip τ 0.001, warm start 1000 steps)"]


def test_a_feedback_command_is_rebuilt_with_switches_as_bare_flags_and_reused_results_as_typed():
    """The command a feedback-efficiency result recorded: a switch that was on is its bare flag (argparse's store_true
    takes no value), one that was off is left out, and every --*-from path is relative to the repository."""
    settings = {"env_id": "Hopper-v5", "reuse_finished": True, "other_switch": False, "workdir": "/x/bench/workdir"}
    settings |= {"baseline_from": ["/abs/repo/bench/results/a.json"], "oracle_from": ["/abs/repo/bench/results/b.json"]}
    command = gen_docs.feedback_command({"settings": settings}, REPO)
    assert command == (
        "python bench/feedback_efficiency.py --env-id Hopper-v5 --reuse-finished --baseline-from bench/results/a.json "
        "--oracle-from bench/results/b.json"
    )


def test_a_rows_table_pools_its_files_in_their_kinds_columns_and_leaves_out_columns_no_file_has():
    """`<!-- table: rows <stems> -->` with several replay files: the rows of each, in order, in the replay columns; a
    column only newer files have shows "–" for the older rows (NaN too: nothing was flipped), and one no file has is
    left out instead of emptying the table."""
    sessions = {f"s{session}": 0.5 for session in range(1, 11)}
    common = {"acc_min": 0.5, "acc_max": 0.6, "r_step": 0.3, "epochs": 2} | sessions
    replay = {"benchmark": "reward_learning_replay"}  # what bench/reward_learning.py replay records: its columns
    older = replay | {"medians": [{"labels_of": "none, seed 1", "variant": "rime"} | common]}
    newer = replay | {"medians": [{"labels_of": "rime, seed 2", "variant": "default", "flipped": float("nan")} | common]}
    page = "<!-- table: rows reward_learning_replay_a reward_learning_replay_b -->\n<!-- /table -->\n"
    lines = gen_docs.fill_tables(page, {"reward_learning_replay_a": older, "reward_learning_replay_b": newer}, "page.md").splitlines()
    assert lines[1].endswith("| r_step | epochs | flipped |") and "flipped_wrong" not in lines[1]
    assert lines[3].startswith("| none, seed 1 | rime | 0.500 |") and lines[3].endswith("| 0.300 | 2 | – |")
    assert lines[4].startswith("| rime, seed 2 | default |") and lines[4].endswith("| 2 | – |")
    assert lines[5] == "<!-- /table -->"


def novel_behaviours_row(seed: int, success: float, ratio: float, late_success: float, late_return: float) -> dict:
    """A bench/novel_behaviours.py row over 90 steps: evaluations at 30 and 60 (the first two thirds) and 90 (the last)."""
    return {
        "seed": seed, "steps": 90, "objective_success": success, "objective_success_last3": success + 1,
        "return_ratio": ratio, "return_ratio_last3": ratio + 1,
        "objective_success_curve": [[30, 100.0], [60, 100.0], [90, late_success]],
        "objective_curve": [[30, 100.0], [60, 100.0], [90, late_return]],
        "ceiling_objective_curve": [[30, 1.0], [60, 1.0], [90, 10.0]],
    }  # fmt: skip


def test_a_settings_table_pools_each_settings_seeds_reads_the_last_third_and_names_the_teacher_where_the_page_does():
    """`<!-- table: settings a+b c -->`: one row per setting (a and b pooled by seed, b's seed 2 replacing a's), named
    by its --preference-flags and when its labels were asked (sessions with labels, from --explore-steps every
    --feedback-frequency while the run lasts, and the first and last session's labels under the run's schedule), each
    column the median [interquartile range] over seeds; the last third averages only the evaluations past 2/3 of the
    steps, and its ratio is the run's late objective return over the ceiling's. `a+b=name` names the teacher a setting
    ran with, which its command cannot show."""
    schedule = "--steps 150000 --labels 1000 --explore-steps 5000 --feedback-frequency 7500 --queries-per-session 50"
    first = {
        "command": f"python bench/novel_behaviours.py {schedule} --preference-flags='--no-surf --reset-agent-below-correlation 0.9'",
        "rows": [],
    }
    first["rows"] = [novel_behaviours_row(1, 1.0, 0.2, 0.0, 2.0), novel_behaviours_row(2, 9.0, 9.0, 9.0, 9.0)]
    second = {"command": "python bench/novel_behaviours.py --seeds 2 3", "rows": []}
    second["rows"] = [novel_behaviours_row(2, 2.0, 0.4, 1.0, 4.0), novel_behaviours_row(3, 3.0, 0.6, 2.0, 6.0)]
    page = "<!-- table: settings novel_a+novel_b novel_b -->\n<!-- /table -->"
    lines = gen_docs.fill_tables(page, {"novel_a": first, "novel_b": second}, "page.md").splitlines()
    assert lines[1].startswith("| preference flags | label sessions | seeds | success, final |")
    assert lines[3] == (
        "| `--no-surf --reset-agent-below-correlation 0.9` | 20, 5k–147.5k, 202 → 3 labels | 1, 2, 3 | 2.00 [1.50, 2.50] | 3.00 [2.50, 3.50] | 1.00 [0.50, 1.50] "
        "| 0.40 [0.30, 0.50] | 1.40 [1.30, 1.50] | 0.40 [0.30, 0.50] |"
    )
    assert lines[4].startswith("| `(none)` | – | 2, 3 | 2.50 [2.25, 2.75] |")
    # `=name` says which teacher a setting's files ran with, in a column of its own (a setting without one: –)
    page = "<!-- table: settings novel_a+novel_b=ties-as-ties novel_b -->\n<!-- /table -->"
    lines = gen_docs.fill_tables(page, {"novel_a": first, "novel_b": second}, "page.md").splitlines()
    assert lines[1].startswith("| preference flags | label sessions | teacher | seeds | success, final |")
    assert lines[3].startswith(
        "| `--no-surf --reset-agent-below-correlation 0.9` | 20, 5k–147.5k, 202 → 3 labels | ties as ties | 1, 2, 3 | 2.00 [1.50, 2.50] |"
    )
    assert lines[4].startswith("| `(none)` | – | – | 2, 3 | 2.50 [2.25, 2.75] |")
    assert lines[2].count("|") == lines[3].count("|")
    # sac_rlhf.py's default schedule is exponential: smaller sessions on average stretch it until they round to
    # no label; an even schedule asks the same each time; in a shorter run, the steps run out before the labels do
    smaller = {"command": schedule.replace("session 50", "session 25").replace("steps 150000", "steps 300000")}
    assert gen_docs.label_sessions(smaller) == "28, 5k–207.5k, 200 → 1 labels"
    even = {"command": schedule + " --preference-flags='--teacher-feedback-schedule linear'"}
    assert gen_docs.label_sessions(even) == "20, 5k–147.5k, 50 → 50 labels"
    even["command"] = even["command"].replace("steps 150000", "steps 50000")
    assert gen_docs.label_sessions(even) == "6, 5k–42.5k, 50 → 50 labels"
    with pytest.raises(SystemExit, match="names novel_c, which bench/results/manifest.yaml does not list"):
        gen_docs.fill_tables("<!-- table: settings novel_a+novel_c -->\n<!-- /table -->", {"novel_a": first}, "page.md")


# The training scripts a page may start, by the name framework/sweep.py loads each by (its Args and its own checks).
TRAINING_SCRIPTS = {"sac_rlhf": "sac-rlhf", "pref_ppo": "pref-ppo", "sac": "sac", "ppo": "ppo"}


def test_every_training_command_the_docs_show_passes_the_scripts_own_checks(monkeypatch, capsys):
    """Long ones too, which no test runs: each command's flags are read by its script's Args and checked by its
    validation, as the script does before it starts (a wrong flag, or --total-timesteps shorter than one PPO rollout,
    fails here). A command that reads what an earlier command on the page writes (a checkpoint, a label store) may find
    it missing; a shell variable is left to the reader."""
    import sweep
    from cleanrlhf_utils.cli import command_line_args
    from cleanrlhf_utils.errors import ConfigError

    checked = 0
    for page in PAGES:
        for command, _ in bash_commands(page.read_text()):
            match = re.match(r"^((?:\w+=\S+ )*)python framework/(\w+)\.py(.*)$", command)
            if not match or match.group(2) not in TRAINING_SCRIPTS or "$" in command:
                continue
            for assignment in match.group(1).split():
                name, _, value = assignment.partition("=")
                if name == "PYTHONPATH":
                    monkeypatch.syspath_prepend(str(REPO / value))
            script = sweep.load_script(TRAINING_SCRIPTS[match.group(2)])
            flags = shlex.split(match.group(3))
            try:
                script.validate(command_line_args(script.Args, flags))
            except ConfigError as error:
                missing = re.search(r" (\S+)(?: does not exist|: no checkpoint there)", str(error))
                assert missing and missing.group(1) in flags, f"{page.relative_to(REPO)}: {command}\n  {error}"
            except SystemExit as exit:
                pytest.fail(f"{page.relative_to(REPO)}: {command}\n  exit {exit.code}: {capsys.readouterr().err.strip()}")
            checked += 1
    assert checked >= 10


def test_a_person_bench_table_shows_the_result_each_task_has():
    """The simulated person's rows: the windmill's table shows the objective's success and not the env's return (0 at
    every step there), a person judging Hopper by its return shows that return and no objective success (None), and a
    success of 0 on every row is still shown (nothing learned is a result)."""
    columns = gen_docs.MEASUREMENT_COLUMNS["simulated_person"]
    windmill = [{"mode": "async", "seed": seed, "eval_return": 0.0, "objective_success": 0.99} for seed in (1, 2)]
    hopper = [{"mode": "async", "seed": seed, "eval_return": 2000.0 + seed, "objective_success": None} for seed in (1, 2)]
    failed = [{"mode": "async", "seed": seed, "eval_return": 0.0, "objective_success": 0.0} for seed in (1, 2)]
    shown = [gen_docs.measured_columns(columns, rows, strict=False) for rows in (windmill, hopper, failed)]
    assert "objective_success" in shown[0] and "eval_return" not in shown[0]
    assert "eval_return" in shown[1] and "objective_success" not in shown[1]
    assert "objective_success" in shown[2]

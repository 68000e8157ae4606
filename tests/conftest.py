import importlib
import os
import sys
from pathlib import Path

# Before anything imports mujoco or wandb.
os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402
import torch  # noqa: E402

# One intra-op thread, as the training scripts' --torch-threads default: torch's default (one per core) made
# the suite several times slower on a busy 2-core machine.
torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[1]
FRAMEWORK_DIR = REPO_ROOT / "framework"
if str(FRAMEWORK_DIR) not in sys.path:
    sys.path.insert(0, str(FRAMEWORK_DIR))

# The single-file algorithm scripts that carry their own copy of the shared components
# (reward ensemble, teacher, samplers, SURF, RUNE...). Adding a script is one line.
ALGORITHM_SCRIPTS = ["sac_rlhf", "pref_ppo"]


@pytest.fixture(params=ALGORITHM_SCRIPTS)
def algo(request):
    """The imported algorithm script; component tests run against every script's copy."""
    return importlib.import_module(request.param)


@pytest.fixture
def chdir_tmp(tmp_path, monkeypatch):
    """Run inside a fresh temporary directory, for anything that writes runs/, models/ or videos/."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ------------------------------------------------------------------------------------------------------------------
# Two tiers. `python -m pytest -q` runs everything (CI does). `python -m pytest -q -m "not slow"` is the quick tier for
# the edit loop: it leaves out the tests below, which train for hundreds or thousands of steps, drive a browser, start
# SLURM, install with Poetry or build the docs site. A whole file (`test_x.py`) or one test with all its parameters
# (`test_x.py::test_y`); a new test that takes long goes here, with what makes it long. docs/development.md has the
# tiers' times.
# ------------------------------------------------------------------------------------------------------------------
SLOW = {
    # training runs: resumed exactly, interrupted, compared, learning a task
    "test_end_to_end.py": "PEBBLE and SAC runs, interrupted, resumed and compared step by step",
    "test_environments.py::test_pebble_runs_on": "a run on each environment of the subset",
    "test_environments.py::test_pebble_resumes_exactly_on_the_control_suite": "two DMC runs, one resumed",
    "test_environments.py::test_pref_ppo_runs_on_the_control_suite": "a PrefPPO run on DMC",
    "test_environments.py::test_no_terminate_when_unhealthy_reaches_training_and_evaluation": "a run of each script",
    "test_environments.py::test_list_envs_reports_pass_and_fail_with_reasons": "list_envs.py tries environments",
    "test_pref_ppo.py::test_cartpole_learns_from_the_oracle_teacher": "PrefPPO learns CartPole",
    "test_pref_ppo.py::test_observation_normalisation_is_saved_and_applied_by_evaluation": "the CartPole run",
    "test_pref_ppo.py::test_file_mode_trains_from_the_labels_a_run_saved": "the CartPole run, and one from its labels",
    "test_pref_ppo.py::test_ppo_baseline_learns_cartpole_from_the_true_reward": "PPO learns CartPole",
    "test_pref_ppo.py::test_hopper_run_writes_scalars_checkpoint_and_feedback": "a PrefPPO run on Hopper",
    "test_pref_ppo.py::test_interrupt_resume_and_exploration_from_continue_exactly": "runs, interrupted and resumed",
    "test_pref_ppo.py::test_a_signal_during_an_evaluation_stops_after_it_and_resumes_exactly": "runs, interrupted and resumed",
    "test_pref_ppo.py::test_interrupt_in_reward_update_redoes_it_exactly": "runs, interrupted and resumed",
    "test_pref_ppo.py::test_feedback_async_puts_the_next_pairs_up_before_the_reward_update": "a run with a slow labeller",
    "test_pref_ppo.py::test_human_mode_gets_exactly_the_labels_given": "a human-mode run answered over HTTP",
    "test_newcomer.py::test_ctrl_c_prints_the_command_that_resumes_the_run": "a run stopped by a signal, then resumed",
    "test_newcomer.py::test_pebble_wall_seconds_after_resume_count_the_whole_run": "a run, interrupted and resumed",
    "test_newcomer.py::test_pref_ppo_wall_seconds_after_resume_count_the_whole_run": "a run, interrupted and resumed",
    "test_newcomer.py::test_the_script_applies_human_defaults_from_its_command_line": "a human-mode run",
    "test_custom_env.py::test_zero_reward_windmill_learns_its_direction_from_labels_alone": "PEBBLE learns the windmill",
    "test_reward_on_policies.py::test_a_real_runs_model_is_read_on_its_policys_episodes_with_the_runs_end_of_an_episode": (
        "a PEBBLE run, its policy played for two 1000-step episodes"
    ),
    "test_rankings.py::test_a_run_learns_from_rankings_and_logs_them_for_file_mode": "a run of each script, and its replay",
    "test_ratings.py::test_a_run_learns_from_ratings_and_logs_them_for_file_mode": "a run of each script, and its replay",
    "test_feedback_reorder.py::test_human_mode_learns_a_persons_reorders_of_the_check_as_the_pairs_they_decide": "a human-mode run",
    "test_custom_env.py::test_sac_rlhf_trains_on_the_windmill_with_an_objective": "a PEBBLE run",
    "test_custom_env.py::test_sac_baseline_trains_on_the_objective_as_its_reward": "a SAC run",
    "test_custom_env.py::test_baseline_ppo_runs_a_module_env_id": "a PPO run",
    "test_custom_env.py::test_toolbox_compares_module_env_runs_by_their_objective": "two runs compared",
    "test_custom_env.py::test_env_without_simulator_state_trains_synthetically_and_human_mode_refuses": "a PEBBLE run",
    "test_metaworld.py::test_pebble_run_logs_the_success_rate_everywhere": "a PEBBLE run on Meta-World",
    "test_metaworld.py::test_pref_ppo_run_logs_the_success_rate": "a PrefPPO run on Meta-World",
    "test_feedback_resume.py::test_resumed_session_asks_the_same_pairs_and_keeps_each_label_once": "runs, interrupted and resumed",
    "test_feedback_resume.py::test_interrupted_reward_update_is_redone_exactly": "runs, interrupted and resumed",
    "test_feedback_resume.py::test_feedback_async_trains_while_people_label": "a run with a slow labeller",
    "test_feedback_resume.py::test_feedback_async_puts_the_next_pairs_up_before_the_reward_update": "a run with a slow labeller",
    "test_feedback_resume.py::test_staged_pairs_survive_an_interrupted_reward_update": "runs, interrupted and resumed",
    "test_human_feedback.py": "a human-mode run answered over HTTP, then a file-mode run of its labels",
    "test_feedback_corrections.py": "human-mode runs whose answers change",
    "test_feedback_outage.py": "human-mode runs whose server is killed",
    "test_feedback_trainer_news.py::test_human_run_sends_its_question_renders_clips_at_real_time_and_page_size_and_keeps_its_server_data": "a human-mode run",
    "test_feedback_hostile.py::test_idle_and_trickling_sockets_keep_nobody_waiting": "1110 sockets trickling for 25 s",
    "test_feedback_trainer_guard.py::test_a_resumed_run_tells_the_page_its_step_and_prints_a_login_link_only_when_asked": "three human-mode runs and Chromium",
    "test_feedback_secrets.py::test_checkpoints_and_sweep_trials_keep_no_token": "a run and a sweep trial",
    "test_reward_gap.py::test_a_frozen_reward_run_is_sac_on_the_loaded_model_which_it_never_changes": "runs",
    "test_reward_gap.py::test_bad_frozen_reward_sources_are_refused_in_one_line": "runs",
    "test_reward_gap.py::test_a_preference_run_logs_the_measurements_at_sessions_and_sac_its_entropy": "runs",
    "test_reward_gap.py::test_a_run_starts_sac_afresh_after_sessions_that_change_the_reward_and_resumes_exactly": "runs",
    "test_reward_gap.py::test_the_oracle_loop_gives_sac_the_envs_reward_times_its_scale_where_pebble_gives_the_models": "a run",
    "test_reward_gap.py::test_the_reward_gap_bench_runs_its_kinds_on_one_seed_and_reads_them_back_when_reused": "a benchmark",
    "test_reward_gap.py::test_combine_reports_the_runs_of_several_invocations_as_one_table_and_refuses_unlike_ones": "benchmarks",
    "test_robust_labels.py::test_a_rime_run_logs_its_selection_and_checkpoints_its_state": "runs",
    "test_robust_labels.py::test_a_rime_run_interrupted_in_its_second_reward_update_resumes_exactly": "runs, resumed",
    "test_robust_labels.py::test_prefppo_takes_rimes_training_through_its_seam": "a PrefPPO run",
    "test_robust_labels.py::test_the_variant_files_run_from_the_command_line_with_pebbles_flags": "two runs",
    "test_robust_labels.py::test_the_replay_fits_a_finished_runs_own_labels_session_by_session_with_the_variants_defence": "a run",
    "test_robust_labels.py::test_the_reward_learning_bench_labels_with_a_noisy_teacher_and_reports_the_selection": "a benchmark",
    "test_novel_behaviours.py::test_the_backflip_bench_runs_sac_on_the_objective_beside_each_preference_run": "a benchmark",
    "test_novel_behaviours.py::test_env_flags_shape_the_environment_of_the_preference_run_and_its_ceiling_alike": "a benchmark",
    "test_sweep.py::test_optuna_sweep_stores_three_trials_and_exports_the_best": "a sweep of three runs",
    "test_sweep.py::test_hopeless_trials_are_pruned_from_intermediate_evaluations": "a sweep",
    "test_sweep.py::test_a_sweep_on_your_own_env_and_objective_ranks_trials_by_the_objective": "a sweep",
    "test_sweep.py::test_wandb_trial_logs_the_metric_to_its_offline_run": "a sweep trial",
    "test_toolbox.py::test_tiny_sac_rlhf_runs_compared": "runs, compared",
    "test_bench.py::test_knn_bench_times_another_commit_in_its_own_worktree_and_checks_the_distances_agree": "a benchmark",
    "test_bench.py::test_throughput_runs_versions_side_by_side_on_one_thread_and_alone_on_more": "a benchmark",
    "test_bench.py::test_a_benchmark_stopped_by_sigterm_lets_its_runs_save_and_leaves_none_running": "a benchmark",
    "test_sac_update.py::test_compiled_update_and_acting_equal_eager": "torch.compile of the update and the actor",
    "test_unchanged_runs.py": "a short run of the default, every preset and both variants",
    "test_seed_commands.py::test_train_explore_load_and_evaluate_as_the_seed_did": "runs of the seed's commands",
    "test_seed_commands.py::test_a_seed_command_trains": "a run of a seed command",
    "test_seed_commands.py::test_a_seed_command_trains_under_xvfb_run": "a run under Xvfb",
    "test_seed_commands.py::test_human_mode_as_the_seed_ran_it_with_the_server_started_by_hand": "a human-mode run",
    "test_seed_commands.py::test_the_seeds_sweep_runs_a_trial_on_the_local_backend": "a sweep trial",
    "test_seed_commands.py::test_the_seeds_wandb_sweep_commands_run_up_to_wandb_and_say_what_it_needs": "wandb's import",
    "test_run_endings.py::test_a_damaged_checkpoint_is_one_line_naming_it_and_the_runs_other_checkpoints": "runs, resumed",
    "test_run_endings.py::test_a_finished_run_says_what_it_reached_in_one_closing_line": "a run",
    "test_run_endings.py::test_the_progress_bar_shows_the_last_evaluation_once_there_is_one": "a run",
    "test_run_endings.py::test_an_interrupted_runs_summary_is_the_checkpoint_it_resumes_from": "runs, interrupted and resumed",
    "test_rating_fit.py::test_a_rating_runs_first_sessions_are_fitted_and_measured_on_the_next": "a rating run, fits",
    # a browser, SLURM, Poetry, the docs site
    "test_feedback_page.py": "the page in Chromium",
    "test_feedback_walk.py": "human-mode runs answered through the page in Chromium",
    "test_feedback_hardening.py::test_a_page_on_another_origin_cannot_label_or_undo": "Chromium",
    "test_simulated_person.py": "a person on the page in Chromium, and a run",
    "test_slurm.py::test_start_job_runs_an_array_whose_tasks_join_one_optuna_study": "a real SLURM cluster",
    "test_first_run.py::test_poetry_installs_a_clean_clone_at_the_locked_versions_and_trains": "poetry install, a clean clone",
    "test_docs.py::test_site_builds_strictly": "mkdocs build",
    "test_docs.py::test_a_broken_internal_link_fails_the_build": "mkdocs build",
    "test_docs.py::test_the_check_names_a_page_made_stale_by_a_docstring_or_a_result": "regenerates every page and plot",
}


def pytest_collection_modifyitems(config, items):
    unknown = set()
    for item in items:
        file = item.path.name
        if file in SLOW or f"{file}::{item.originalname}" in SLOW:
            item.add_marker(pytest.mark.slow)
        for entry in SLOW:
            name, _, test = entry.partition("::")
            if name == file and test and not hasattr(item.module, test):
                unknown.add(entry)
    for entry in SLOW:
        if not (REPO_ROOT / "tests" / entry.partition("::")[0]).is_file():
            unknown.add(entry)
    if unknown:
        raise pytest.UsageError(f"tests/conftest.py's SLOW names tests that do not exist: {', '.join(sorted(unknown))}")


# The quick tier stays quick only while long tests are listed: a test outside the slow tier whose own run (its shared
# fixtures apart) takes longer than this is named at the end of the run, to be listed (it does not fail).
QUICK_TEST_SECONDS = 20.0


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    reports = [report for reports in terminalreporter.stats.values() for report in reports if hasattr(report, "duration")]
    long = sorted(
        (report.duration, report.nodeid)
        for report in reports
        if getattr(report, "when", None) == "call" and "slow" not in report.keywords and report.duration > QUICK_TEST_SECONDS
    )
    if long:
        terminalreporter.section(f"tests outside the slow tier that took longer than {QUICK_TEST_SECONDS:.0f} s")
        for duration, nodeid in reversed(long):
            terminalreporter.write_line(f"{duration:6.1f} s  {nodeid}  (list it in tests/conftest.py's SLOW)")

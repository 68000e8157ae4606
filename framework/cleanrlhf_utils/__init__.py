"""Infrastructure shared by CleanRLHF's single-file algorithm scripts, as CleanRL keeps cleanrl_utils: environments and
simulator states (envs), the replay buffer (buffers), every teacher and the feedback server's client (feedback), a run's
folders, checkpoints, logging and summary (run, checkpoints, tracking), evaluation, measurements of the learned reward
(diagnostics), and the command line (arguments, cli).

What a researcher opens a script to read and change (the agent, the reward model and its loss, query selection, SURF,
RUNE, exploration and the training loop) stays in the script."""

from .headless import default_mujoco_gl

default_mujoco_gl()  # before mujoco or dm_control is imported: no GLFW probe (and X11 warning) on a headless machine

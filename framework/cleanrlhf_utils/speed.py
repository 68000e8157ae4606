"""Speed-ups that change no result, each behind one call of the algorithm scripts: Adam on fused kernels (`adam`), the
SAC update and acting compiled and replayed as CUDA graphs (`compiled_steps`, --compile and --cudagraphs), and the
k-th nearest neighbour's distance found without ranking every distance (`kth_nearest_distance`, PEBBLE's state
entropy). bench/throughput.py and bench/knn.py time them; tests/test_sac_update.py and tests/test_components.py check
that each gives what the plain computation gives."""

import functools

import torch
import torch.nn.functional as F


def adam(params, lr: float, args) -> torch.optim.Adam:
    """Adam on one fused kernel per tensor instead of a dozen element-wise ops (measured: 9 % of an SAC update's CPU
    time at one thread). Compiled (--compile), inductor fuses the plain (foreach) Adam itself; CUDA graphs
    (--cudagraphs) need its state on the GPU."""
    if args.compile or args.cudagraphs:
        return torch.optim.Adam(params, lr=lr, foreach=True, capturable=args.cudagraphs)
    return torch.optim.Adam(params, lr=lr, fused=True)


def outputs_copied(step):
    """`step` (a function returning a dict of tensors) with its outputs copied as they come out. A CUDA graph
    (--cudagraphs) returns tensors in its static memory, which the next replay of any of the run's graphs overwrites,
    and an update's stats are read later (logging), after more replays."""

    @functools.wraps(step)
    def copied(*args):
        return {name: value.clone() for name, value in step(*args).items()}

    return copied


def compiled_steps(args, critic_step, actor_step, policy) -> tuple:
    """(critic_step, actor_step, policy) as a run executes them: as given, compiled with --compile (fused kernels), or
    also replayed as CUDA graphs with --cudagraphs (the update steps' outputs then copied out of the graphs' memory).
    Compiled code draws eager's random numbers, so compiling keeps a run's results."""
    if not (args.compile or args.cudagraphs):
        return critic_step, actor_step, policy
    torch._inductor.config.fallback_random = True
    mode = "reduce-overhead" if args.cudagraphs else None
    critic_step, actor_step, policy = (torch.compile(step, mode=mode) for step in (critic_step, actor_step, policy))
    if args.cudagraphs:
        critic_step, actor_step = outputs_copied(critic_step), outputs_copied(actor_step)
    return critic_step, actor_step, policy


def kth_nearest_distance(states: torch.Tensor, reference: torch.Tensor, k: int, group: int = 64) -> torch.Tensor:
    """Distance from each state (B, D) to its k-th nearest neighbour among `reference` (M, D), k <= M.

    A top-k over all M distances of every state was most of the cost. The distances are cut into groups of `group`
    instead: the k-th nearest neighbour lies in one of the k groups with the nearest minima (those minima are k
    distinct neighbours no farther than the k-th smallest minimum), so only those k x group candidates are ranked.
    Squared distances less |s|^2 come from one matmul; the root is taken of the k-th only (timed: bench/knn.py)."""
    partial = torch.addmm((reference * reference).sum(1), states, reference.T, alpha=-2)  # |r|^2 - 2 s.r
    if partial.shape[1] % group:
        partial = F.pad(partial, (0, -partial.shape[1] % group), value=float("inf"))
    groups = partial.unflatten(1, (-1, group))
    nearest_groups = groups.amin(2).topk(min(k, groups.shape[1]), dim=1, largest=False, sorted=False).indices
    candidates = groups[torch.arange(len(groups), device=groups.device)[:, None], nearest_groups].flatten(1)
    kth = candidates.topk(k, dim=1, largest=False, sorted=False).values.amax(1)
    return (kth + (states * states).sum(1)).clamp_min(0).sqrt()

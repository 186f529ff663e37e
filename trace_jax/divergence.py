"""Signs that a run is going bad, checked after every RL step: `check_divergence` raises
`Diverged` (the training main exits with status 70, keeping the last good checkpoint)."""

from __future__ import annotations

from trace_jax.run_state import LoopState, Run


class Diverged(RuntimeError):
  """The run stopped on a sign of divergence (consecutive skipped updates, exploding parameters,
  held-out accuracy collapsed to zero); nothing was checkpointed after the first bad step."""


def check_divergence(run: Run, state: LoopState, rec: dict) -> None:
  """Raises `Diverged` when the step's record shows the run going bad: `rl.max_consecutive_skips`
  RL steps' worth of updates in a row skipped as non-finite (times `rl.ppo_epochs` x
  `rl.minibatches` optimizer updates, so one bad batch, every update of its step skipped, counts
  as one), parameters grown past `rl.max_param_growth` times their warm-start norm (or not
  finite), or, with `eval.stop_on_collapse`, held-out EM fallen to zero from a positive start."""
  c = run.c
  latest = run.ckpt.latest_step()
  keep = (f"the last checkpoint (step {latest}) is kept" if latest is not None
          else "no checkpoint was written")
  why = None
  per_step = c.rl.ppo_epochs * c.rl.minibatches
  if state.skip_streak >= c.rl.max_consecutive_skips * per_step:
    why = (f"{state.skip_streak} consecutive updates ({per_step} per RL step) had non-finite loss, "
           f"gradients or parameters and were skipped")
  norm = rec.get("param_norm")
  if norm is not None and not norm <= c.rl.max_param_growth * max(run.init_param_norm, 1e-6):
    why = (f"the parameter norm reached {norm:.4g}, over rl.max_param_growth="
           f"{c.rl.max_param_growth:g} x its warm-start norm {run.init_param_norm:.3g}")
  em0, em = state.evals.get("0"), state.evals.get(str(state.step))
  if c.eval.stop_on_collapse and "eval_em" in rec and em0 and em0 > 0 and em == 0:
    why = f"held-out greedy EM collapsed from {em0:.3f} to 0 (eval.stop_on_collapse)"
  if why:
    raise Diverged(f"training diverged at RL step {state.step}: {why}; {keep} under "
                   f"{run.ckpt.directory}. Lower rl.lr, or raise the limit if this is expected.")

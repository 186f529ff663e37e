"""Which prompts the predictor's fit holds out (`rl.predictor_holdout`).

One function, read by both sides that train the head: the fitter (`predictor_fit.PredictorFitter`)
keeps these prompts out of its fit and early-stops on their loss, and the joint update's batch
builders (`rl.batch`) give their nodes no predictor weight, so no step of either trains the head on
them and the held-out loss stays an honest one. Pure numpy, so `rl` imports it without pulling in
the fitter (rl may import allocation; allocation never imports rl).
"""

from __future__ import annotations

import zlib

import numpy as np


def held_out(prompt_ids, share: float) -> bool:
  """Whether a prompt is in the held-out share: a hash of its token ids, so the same prompt is
  held out at every step and in every process."""
  if share <= 0:
    return False
  h = zlib.crc32(np.asarray(prompt_ids, np.int64).tobytes())
  return (h % 10007) < share * 10007


__all__ = ["held_out"]

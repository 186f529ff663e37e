"""The run configs: ml_collections files that select a task and a variant and override values.

  base.py       the config every task starts from, the smoke shrink, `validate`
  mhqa.py       multi-hop QA with search (the synthetic worlds, real data, Qwen3 variants)
  tool_math.py  tool-use math (a calculator)
  fc.py         function calling (a stateful API)
  convert.py    ConfigDict -> the library's typed `trace_jax.config.TrainConfig`, values checked
  runs.py       a finished run's config, read back from its workdir

Use `--config=configs/mhqa.py:smoke` on the command line, or `from configs import mhqa` in Python
(the package is installed with the library).
"""

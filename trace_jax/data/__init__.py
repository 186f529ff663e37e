"""QA datasets: readers for the standard formats and TFDS array_record builders.

The TFDS helpers live in `trace_jax.data.tfds_builder` and are not imported here, so reading a
file does not pay for importing tensorflow_datasets.
"""

from trace_jax.data.formats import FORMATS
from trace_jax.data.formats import LoadStats
from trace_jax.data.formats import QAExample
from trace_jax.data.formats import QAFormatError
from trace_jax.data.formats import detect_format
from trace_jax.data.formats import load_qa

__all__ = ["FORMATS", "LoadStats", "QAExample", "QAFormatError", "detect_format", "load_qa"]

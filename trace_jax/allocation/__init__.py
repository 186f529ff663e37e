"""TRACE's contribution: the pure allocators, the predictor fit and its metrics, the step driver,
and the strategies (one module per method behind one interface)."""

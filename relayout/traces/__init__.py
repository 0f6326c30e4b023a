"""Routing traces on relayout's side: importers of the formats runtimes write (one module per
format, :mod:`relayout.traces.importer` choosing among them), the statistics ``relayout trace
stats`` prints (:mod:`relayout.traces.stats`), and synthetic traces with real structure
(:mod:`relayout.traces.synth`). The trace itself and its file are :mod:`replay.model.routing` and
:mod:`replay.formats.trace`."""

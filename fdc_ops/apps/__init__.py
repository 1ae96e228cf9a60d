"""The command-line applications built on the library: the demo (the main job), the operator demo, the accuracy
evaluation against compression, the calibration report, and what they share (metrics, provenance of results).
``python -m fdc_ops <command>`` runs them (:mod:`fdc_ops.apps.cli`)."""

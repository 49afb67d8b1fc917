"""Benchmarks of odc_hf, one folder per topic; run each as ``python -m benchmarks.<folder>.<script>`` from the checkout
(docs/benchmarks.md: what each measures, and the index of every report under ``benchmarks/results/<topic>/``)."""

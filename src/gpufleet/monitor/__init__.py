"""Measuring a run and saying in plain words why it is slow.

* what is measured: step phases on every rank (``phases``), FLOPs and MFU (``flops``),
  GPUs and host (``system``; the GPUs through NVML: ``nvml``), node-to-node links
  (``links``), profiler traces on request (``profile``);
* the diagnosis: its findings and facts (``findings``), the rules (``diagnose``,
  ``host_rules``), the trainer's side that runs them each log interval (``advisor``),
  and ``gpufleet tune``, which applies them (``tune``);
* where it goes: ``metrics.jsonl`` (``jsonl``, ``metrics``), TensorBoard, MLflow and
  W&B (``sinks``), the live view (``progress``), ``report.html`` (``report``,
  ``report_svg``, ``gpufleet report``: ``report_cli``) and ``gpufleet top``.
"""

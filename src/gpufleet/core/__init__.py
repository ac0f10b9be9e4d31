"""The bottom layer: what every other package may use, importing nothing from gpufleet.

* :mod:`gpufleet.core.callbacks`: the callback protocol the loop calls and monitors,
  fault handlers and displays implement.
* :mod:`gpufleet.core.tree`: walking a (nested) batch of tensors: moving and sizing it.
* :mod:`gpufleet.core.machine`: facts about the host (CPU model, usable cores).

``tests/test_layers.py`` checks that this package imports nothing else of gpufleet.
"""

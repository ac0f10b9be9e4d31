"""The engine both loops share: what a step and the end of a run go through, the same
for :class:`~gpufleet.train.loop.Trainer` and for your own loop under
:class:`~gpufleet.fleet.Fleet`."""

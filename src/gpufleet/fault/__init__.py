"""Surviving faults and saying what they were.

* ``watchdog``: a stalled step noticed long before the process-group timeout; every
  rank dumps its stacks and rank 0 reports which rank is behind;
* ``liveness``: heartbeats over the job's store, telling a rank that stopped answering
  from one that is slow;
* ``preempt``: on SIGTERM or SIGUSR1 every rank finishes the same step, writes a
  checkpoint and exits with a status that means "run me again";
* ``crash``: the report a failing rank leaves, in plain words;
* ``ncclenv``: NCCL settings that make a failing or hanging job say so.

The ``[fault]`` config section also turns on skipping a non-finite step; that guard
runs in the training loop (:mod:`gpufleet.train.guard.nonfinite`).
"""

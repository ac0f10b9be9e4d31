"""``gpufleet doctor``: is this machine ready to train, and is its NCCL set up as intended?

The command lives in :mod:`gpufleet.doctor.cli`, the checks in
:mod:`gpufleet.doctor.checks` (which findings block training is documented there), the
known environment variables in :mod:`gpufleet.doctor.envvars`.
"""

"""``gpufleet plan``: a layout's memory, communication and FLOPs per rank, worked out on
one CPU machine for a cluster that is not there (torch's fake process group and the
meta device), and whether it fits a named GPU."""

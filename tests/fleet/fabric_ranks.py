"""Fabric's collective call forms on the 2 ranks a Fleet starts (run by
tests/fleet/test_fabric_calls.py): ``group=`` on all_reduce and all_gather, a named
barrier, ``fleet.strategy``; the ranks are those a subclass's own ``run()`` starts. Each
rank writes what it saw to ``OUT/rank-R.pt``, the parent rank 0's result to
``OUT/result.txt``."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import gpufleet
from gpufleet.core.ring import RING
from gpufleet.errors import ConfigError


def collectives(fleet, out):
    rank = fleet.global_rank
    both, alone = dist.new_group([0, 1]), dist.new_group([1])  # every rank makes each
    seen = {
        "sum": fleet.all_reduce(torch.tensor([rank + 1.0]), both, "sum").tolist(),
        "mean": fleet.all_reduce({"x": rank + 1.0, "t": [torch.ones(2) * rank]}, group=both),
        "old_form": fleet.all_reduce(rank + 1.0, "max"),  # Fleet's reduce op, second
        "ops": [fleet.all_reduce(rank + 1.0, reduce_op=op) for op in (
            dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MIN, "AVG", "Max")],
    }
    x = torch.tensor([rank + 1.0], requires_grad=True)
    gathered = fleet.all_gather(x * 2, both, sync_grads=True)
    gathered.sum().backward()
    seen["gathered"], seen["grad"] = gathered.tolist(), x.grad.tolist()
    if rank == 1:  # the only rank of `alone`: its rank 0 there
        seen["alone"] = fleet.all_reduce(5.0, alone)
        y = torch.tensor([3.0], requires_grad=True)
        one = fleet.all_gather(y, alone, sync_grads=True)
        one.sum().backward()
        seen["alone_gather"], seen["alone_grad"] = one.tolist(), y.grad.tolist()
    else:
        try:
            fleet.all_reduce(5.0, alone)
        except ConfigError as error:
            seen["outside"] = str(error)
    # 35 evaluation samples on 2 ranks: the sampler repeats one so both read 18
    ids = torch.utils.data.TensorDataset(torch.arange(35.0))
    loader = fleet.setup_dataloaders(torch.utils.data.DataLoader(ids, batch_size=4))
    seen["for_metrics"] = torch.cat([fleet.gather_for_metrics(x) for (x,) in loader]).tolist()
    seen["plain"] = torch.cat([fleet.all_gather(x).flatten(0, 1) for (x,) in loader]).tolist()
    # Accelerate's order: whole batches dealt in turn (compared with Accelerate's own
    # prepare_data_loader by the test), and gather_for_metrics dropping its padding
    torch.manual_seed(7)  # a script seeded alike on every rank
    dealt = fleet.setup_dataloaders(
        torch.utils.data.DataLoader(list(range(35)), batch_size=4, shuffle=True),
        order="accelerate")
    seen["accelerate_order"] = [[b.tolist() for b in dealt] for _ in range(2)]
    seen["accelerate_metrics"] = torch.cat([fleet.gather_for_metrics(b)
                                            for b in dealt]).tolist()
    strategy = fleet.strategy  # Fabric's fabric.strategy, as a loop reads it
    seen["strategy"] = [str(strategy.root_device), strategy.world_size, strategy.global_rank,
                        strategy.reduce_boolean_decision(rank == 1, all=False),
                        strategy.reduce_boolean_decision(rank == 1),
                        strategy.reduce_boolean_decision(True)]
    strategy.barrier()
    fleet.barrier(name="after-groups")
    seen["ring"] = [entry["op"] for entry in RING.snapshot()["entries"]]
    torch.save(seen, Path(out) / f"rank-{rank}.pt")


class RankChecks(gpufleet.Fleet):
    """Fabric's older form: a subclass whose ``run()`` is the loop, launched by calling
    it (on each of the ranks it starts; rank 0's result comes back)."""

    def run(self, out):
        collectives(self, out)
        return self.global_rank


if __name__ == "__main__":
    fleet = RankChecks(accelerator="cpu", devices=2, run_dir=sys.argv[1] + "/run")
    Path(sys.argv[1], "result.txt").write_text(str(fleet.run(sys.argv[1])))

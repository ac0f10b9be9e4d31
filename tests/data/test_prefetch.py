import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gpufleet.data.prefetch import DevicePrefetcher


def _nested_batches() -> list:
    return [
        (torch.arange(4) + i, {"mask": torch.ones(2, 2) * i, "ids": [torch.tensor([i]), "x"]})
        for i in range(3)
    ]


def test_cpu_passes_the_same_objects_through_in_order():
    batches = _nested_batches()
    out = list(DevicePrefetcher(batches, torch.device("cpu")))
    assert len(out) == len(batches)
    for got, want in zip(out, batches, strict=True):
        assert got is want  # no copies, no re-wrapping


def test_cpu_stops_and_can_be_iterated_again():
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4)
    pre = DevicePrefetcher(loader, "cpu")
    assert len(pre) == 3
    it = iter(pre)
    first = [b[0].tolist() for b in it]
    assert first == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
    with pytest.raises(StopIteration):
        next(it)
    assert [b[0].tolist() for b in pre] == first  # a second epoch starts over


def test_len_needs_a_sized_loader():
    pre = DevicePrefetcher(iter([torch.zeros(1)]), "cpu")
    with pytest.raises(TypeError, match="no length"):
        len(pre)
    assert [t.item() for t in pre] == [0.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_batches_arrive_intact():
    data = TensorDataset(torch.randn(64, 8), torch.arange(64))
    loader = DataLoader(data, batch_size=16, pin_memory=True)
    device = torch.device("cuda")
    got = []
    for x, y in DevicePrefetcher(loader, device):
        assert x.device.type == "cuda" and y.device.type == "cuda"
        got.append((x * 2).cpu())  # compute on the current stream, after the wait
        assert y.cpu().tolist() == list(range(y[0].item(), y[0].item() + 16))
    torch.testing.assert_close(torch.cat(got), data.tensors[0] * 2)
    nested = _nested_batches()
    for got_b, want in zip(DevicePrefetcher(nested, device), nested, strict=True):
        assert got_b[0].is_cuda and got_b[1]["ids"][1] == "x"
        torch.testing.assert_close(got_b[1]["mask"].cpu(), want[1]["mask"])

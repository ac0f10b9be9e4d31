import json
import logging
import os
import pickle
import random

import numpy as np
import pytest
from torch.utils.data import DataLoader

from gpufleet.data import jsonl as jsonl_module
from gpufleet.data.jsonl import JsonlDataset, JsonlError


def _records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": i, "text": "w" * rng.randrange(0, 40), "label": rng.randrange(5)}
            for i in range(n)]


def _write(path, lines: list[str], trailing_newline: bool = True) -> None:
    text = "\n".join(lines) + ("\n" if trailing_newline else "")
    path.write_bytes(text.encode("utf-8"))


@pytest.fixture
def data_file(tmp_path):
    records = _records(500)
    path = tmp_path / "data.jsonl"
    _write(path, [json.dumps(r) for r in records])
    return path, records


def _first(batch):  # module level: collate functions travel to the workers
    return batch[0]


def test_round_trip(data_file):
    path, records = data_file
    ds = JsonlDataset(path)
    assert len(ds) == len(records)
    assert [ds[i] for i in range(len(ds))] == records
    assert ds[-1] == records[-1]
    assert ds.skipped == 0 and ds.skipped_lines == []
    assert ds.index_path == path.with_name("data.jsonl.idx")
    assert ds.index_path.exists()


def test_random_access_and_line_numbers(data_file):
    path, records = data_file
    ds = JsonlDataset(path)
    order = list(range(len(ds)))
    random.Random(1).shuffle(order)
    for i in order:
        assert ds[i] == records[i]
        assert ds.line_number(i) == i + 1
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_small_chunks_give_the_same_index(data_file, monkeypatch, tmp_path):
    path, records = data_file
    monkeypatch.setattr(jsonl_module, "CHUNK_BYTES", 7)  # lines span many chunks
    ds = JsonlDataset(path, index_path=tmp_path / "small.idx")
    assert [ds[i] for i in range(len(ds))] == records


def test_index_is_reused_then_rebuilt(data_file, caplog):
    path, records = data_file
    ds = JsonlDataset(path)
    idx = ds.index_path
    before = idx.stat().st_mtime_ns
    caplog.clear()  # the first open's "building" line is captured when INFO is on already
    with caplog.at_level(logging.INFO, logger="gpufleet.data.jsonl"):
        again = JsonlDataset(path)
    assert idx.stat().st_mtime_ns == before
    assert "building" not in caplog.text
    assert again[3] == records[3]

    _write(path, ['{"new": 1}', '{"new": 2}'])
    os.utime(path, ns=(before + 10**9, before + 10**9))  # a different mtime for sure
    changed = JsonlDataset(path)
    assert len(changed) == 2 and changed[1] == {"new": 2}
    assert idx.stat().st_mtime_ns != before
    assert not list(idx.parent.glob("*.tmp*"))  # built atomically, no leftovers


def test_stale_dataset_refuses_to_read_a_changed_file(data_file):
    path, _ = data_file
    ds = JsonlDataset(path)
    _write(path, ['{"new": 1}'])
    with pytest.raises(JsonlError, match="changed after its index"):
        ds[0]


def test_no_trailing_newline(tmp_path):
    path = tmp_path / "d.jsonl"
    _write(path, ['{"a": 1}', '{"a": 2}'], trailing_newline=False)
    ds = JsonlDataset(path)
    assert [ds[0], ds[1]] == [{"a": 1}, {"a": 2}]


def test_empty_lines_are_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\n{"a": 1}\n\n\r\n{"a": 2}\r\n\n\n{"a": 3}\n\n')
    ds = JsonlDataset(path)
    assert [ds[i] for i in range(len(ds))] == [{"a": 1}, {"a": 2}, {"a": 3}]
    assert [ds.line_number(i) for i in range(len(ds))] == [2, 5, 8]


def test_empty_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"")
    assert len(JsonlDataset(path)) == 0


def test_unicode(tmp_path):
    path = tmp_path / "d.jsonl"
    records = [{"t": "héllo wörld"}, {"t": "日本語 🎉"}, {"t": "\u2028 line sep"}]
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n",
                    encoding="utf-8")
    ds = JsonlDataset(path)
    assert [ds[i] for i in range(len(ds))] == records


def test_transform(data_file):
    path, records = data_file
    ds = JsonlDataset(path, transform=lambda r: r["label"])
    assert ds[7] == records[7]["label"]


def test_malformed_line_raises_with_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    _write(path, ['{"a": 1}', "", '{"a": 2', '{"a": 3}'])
    ds = JsonlDataset(path)
    assert ds[0] == {"a": 1} and ds[2] == {"a": 3}
    with pytest.raises(ValueError, match=r"d\.jsonl:3: malformed JSON .*'\{\"a\": 2'"):
        ds[1]


def test_skip_mode_counts_and_skips(tmp_path, caplog):
    path = tmp_path / "d.jsonl"
    lines = ['{"a": 0}', "oops", '{"a": 1}', '{"a": ', "", '{"a": 2}', "\xff"]
    path.write_bytes("\n".join(lines[:-1]).encode() + b"\n\xff\xfe\n" + b'{"a": 3}')
    with caplog.at_level(logging.WARNING, logger="gpufleet.data.jsonl"):
        ds = JsonlDataset(path, on_error="skip")
    assert [ds[i] for i in range(len(ds))] == [{"a": i} for i in range(4)]
    assert ds.skipped == 3
    assert ds.skipped_lines == [2, 4, 7]
    assert [ds.line_number(i) for i in range(len(ds))] == [1, 3, 6, 8]
    assert caplog.text.count("skipped 3 malformed") == 1
    # The raise-mode index differs (built without validation), so switching rebuilds.
    strict = JsonlDataset(path)
    assert len(strict) == 7 and strict.skipped == 0


def test_bad_on_error_names_the_choices(data_file):
    with pytest.raises(ValueError, match="Did you mean 'skip'"):
        JsonlDataset(data_file[0], on_error="skp")


def test_foreign_index_file_is_rebuilt(data_file):
    path, records = data_file
    path.with_name("data.jsonl.idx").write_bytes(b"not an index")
    assert JsonlDataset(path)[5] == records[5]


def test_dataloader_workers_match_in_process(data_file):
    path, _ = data_file
    ds = JsonlDataset(path, on_error="skip")
    expected = [ds[i] for i in range(len(ds))]
    loader = DataLoader(ds, batch_size=1, num_workers=2, collate_fn=_first)
    assert list(loader) == expected


def test_pickle_does_not_carry_the_maps(data_file):
    path, records = data_file
    ds = JsonlDataset(path)
    ds[0]  # opens the maps in this process
    assert isinstance(ds._data, np.memmap)
    blob = pickle.dumps(ds)
    assert len(blob) < 2000  # paths and counts only, not the ~20 kB file
    clone = pickle.loads(blob)
    assert clone._data is None and clone._offsets is None
    assert clone[9] == records[9]

"""Batch: construction, field and row operations, and transport (pickle protocol 5)."""
import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from hybridrl.protocol import Batch, BatchError


def make(n: int = 5) -> Batch:
    return Batch({"ids": torch.arange(n * 3).reshape(n, 3), "score": torch.arange(n, dtype=torch.float32) / 2},
                 {"text": [f"p{i}" for i in range(n)]}, {"step": 7})


def test_construction_and_access():
    b = make()
    assert len(b) == 5 and sorted(b.keys()) == ["ids", "score", "text"]
    assert b["text"].tolist() == ["p0", "p1", "p2", "p3", "p4"]
    assert torch.equal(b["score"], torch.tensor([0, 0.5, 1, 1.5, 2]))
    assert b.meta == {"step": 7}
    td = Batch(TensorDict({"x": torch.ones(4, 2)}, batch_size=[4]))
    assert len(td) == 4
    assert len(Batch(non_tensors={"uid": np.array(["a", "b"], dtype=object)})) == 2
    assert len(Batch()) == 0
    b["mask"] = torch.ones(5, 3, dtype=torch.bool)
    b["uid"] = list(range(5))
    assert "mask" in b and b["uid"].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(BatchError, match="share batch dim 0"):
        Batch({"a": torch.ones(3)}, {"t": ["x", "y"]})
    with pytest.raises(BatchError, match="need 5 rows"):
        b["bad"] = torch.ones(4)
    with pytest.raises(BatchError, match="meta"):
        Batch({"a": torch.tensor(1.0)})
    with pytest.raises(KeyError, match="no field 'nope'"):
        b["nope"]


def test_select_pop_union():
    b = make()
    s = b.select("ids", "text")
    assert sorted(s.keys()) == ["ids", "text"] and s.meta == {"step": 7}
    popped = b.pop("score")
    assert sorted(b.keys()) == ["ids", "text"] and popped.keys() == ["score"]
    u = b.union(popped)
    assert u.equals(make())
    assert b.union(make()).equals(make())  # shared keys with equal values are fine
    other = make()
    other["ids"] = other["ids"] + 1
    with pytest.raises(BatchError, match="'ids' differs"):
        make().union(other)
    with pytest.raises(BatchError, match="rows"):
        make().union(make(4))
    with pytest.raises(KeyError):
        b.select("missing")


def test_rows_index_split_chunk_concat():
    b = make(7)
    assert b[2]["text"].tolist() == ["p2"] and b[-1]["text"].tolist() == ["p6"]
    assert b[np.int64(3)]["text"].tolist() == ["p3"]
    assert b[1:3]["text"].tolist() == ["p1", "p2"]
    picked = b.index(torch.tensor([6, 0, 3]))
    assert picked["text"].tolist() == ["p6", "p0", "p3"] and torch.equal(picked["ids"][:, 0], torch.tensor([18, 0, 9]))
    mask = b["score"] > 1.5
    assert b.index(mask)["text"].tolist() == ["p4", "p5", "p6"]
    chunks = b.chunk(3)
    assert [len(c) for c in chunks] == [3, 2, 2]
    assert [t for c in chunks for t in c["text"]] == [f"p{i}" for i in range(7)]
    assert Batch.concat(chunks).equals(b)
    assert [len(c) for c in b.chunk(9)] == [1] * 7 + [0, 0]
    parts = b.split([1, 0, 6])
    assert [len(p) for p in parts] == [1, 0, 6] and Batch.concat(parts).equals(b)
    with pytest.raises(BatchError, match="sum to 7"):
        b.split([3, 3])
    with pytest.raises(BatchError, match="fields"):
        Batch.concat([make(2), make(2).select("ids")])


def test_repeat_interleave_and_padding():
    b = make(3)
    r = b.repeat_interleave(2)
    assert r["text"].tolist() == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert torch.equal(r["score"], torch.tensor([0, 0, 0.5, 0.5, 1, 1]))
    padded, pad = make(5).pad_to_multiple(4)
    assert (len(padded), pad) == (8, 3)
    assert padded["text"].tolist()[5:] == ["p0", "p1", "p2"]
    assert padded.unpad(pad).equals(make(5))
    same, zero = make(4).pad_to_multiple(2)
    assert zero == 0 and same.equals(make(4))
    assert make(0).pad_to_multiple(2)[1] == 0


def test_pickle_out_of_band_and_dtypes():
    b = Batch({"f": torch.randn(4, 8), "h": torch.randn(4, 2).to(torch.bfloat16),
               "m": torch.tensor([True, False, True, True]), "t": torch.randn(8, 4).t()},  # non-contiguous
              {"text": ["a", "b", "c", "d"]}, {"temperature": 0.7})
    plain = pickle.loads(pickle.dumps(b))
    assert plain.equals(b) and plain["h"].dtype == torch.bfloat16
    buffers: list = []
    payload = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 4  # each tensor travels out of band (zero-copy into Ray's object store)
    big = Batch({"x": torch.zeros(1024, 1024)})
    big_buffers: list = []
    assert len(pickle.dumps(big, protocol=5, buffer_callback=big_buffers.append)) < 4096
    # the receiver copies read-only buffers so in-place writes never touch shared memory
    readonly = [pickle.PickleBuffer(memoryview(bytes(buf.raw()))) for buf in buffers]
    received = pickle.loads(payload, buffers=readonly)
    assert received.equals(b)
    received["f"].add_(1.0)
    assert torch.equal(received["f"], b["f"] + 1.0)


def test_to_device_keeps_fields():
    b = make().to("cpu")
    assert b.equals(make()) and b["ids"].device.type == "cpu"

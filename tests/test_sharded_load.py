"""Loading the policy straight into FSDP2 shards (``asyncrl/learner/sharded_load.py``): each
rank reads only its rows of the checkpoint files, and never loads the whole model; what
cannot be loaded so is named, and loaded whole as before. That the pieces equal the
one-rank model's rows and the step equals one rank's is ``test_sharded_learner.py``'s
equivalence test."""

from __future__ import annotations

import asyncio
import logging
import math
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_sharded_learner import assert_rank_holds_its_slices, config, held, started
from transformers import AutoModelForCausalLM

from asyncrl.config import ModelConfig
from asyncrl.learner import sharded_load
from asyncrl.learner.distributed import Sharding
from asyncrl.learner.sharded_load import WholeLoadNeeded, build_skeleton, compute_buffers, shard_rows, tensor_files
from asyncrl.policy import load_policy
from asyncrl.runtime import learner_worker
from asyncrl.runtime.learner_worker import LearnerWorker


def test_shard_rows_split_as_torch_chunk_does():
    assert [shard_rows(261, r, 2) for r in range(2)] == [(0, 131), (131, 261)]
    assert [shard_rows(5, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]  # the last rank: none
    assert [shard_rows(1, r, 3) for r in range(3)] == [(0, 1), (1, 1), (1, 1)]


@pytest.fixture(scope="module")
def split_policy_dir(policy_dir, tmp_path_factory):
    """The tiny policy saved in several safetensors files, with their index."""
    path = tmp_path_factory.mktemp("split_policy")
    AutoModelForCausalLM.from_pretrained(policy_dir).save_pretrained(path, max_shard_size="100KB")
    for f in policy_dir.iterdir():
        if not (path / f.name).exists() and not f.name.startswith("model"):
            shutil.copy(f, path / f.name)
    assert (path / sharded_load.INDEX_FILE).is_file() and len(set(tensor_files(path).values())) > 1
    return path


class CountingFile:
    """A safetensors file handle that counts the elements of every tensor read through it."""

    def __init__(self, handle, read: list[int]) -> None:
        self.handle, self.read = handle, read

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, name):
        tensor = self.handle.get_tensor(name)
        self.read.append(tensor.numel())
        return tensor

    def get_slice(self, name):
        return CountingSlice(self.handle.get_slice(name), self.read)


class CountingSlice:
    def __init__(self, part, read: list[int]) -> None:
        self.part, self.read = part, read

    def __getitem__(self, index):
        tensor = self.part[index]
        self.read.append(tensor.numel())
        return tensor


def loaded_whole(*args, **kwargs):
    raise AssertionError("a rank loaded the whole model (load_policy)")


class CountingReads(LearnerWorker):
    """A rank whose every read from the checkpoint files is counted, and which fails if it
    loads the model any other way."""

    def join(self, init_method=None, local_rank=0):
        self.read = []
        opened = sharded_load.safe_open
        sharded_load.safe_open = lambda *args, **kwargs: CountingFile(opened(*args, **kwargs), self.read)
        learner_worker.load_policy = loaded_whole  # this rank process's own module: nothing else sees it
        super().join(init_method, local_rank)


def elements_read(worker):
    return sum(worker.read)


@pytest.mark.slow
def test_each_rank_reads_only_its_rows_of_a_model_in_several_files(split_policy_dir):
    """Two FSDP2 ranks, the model in bf16 from float32 files: each reads exactly the
    elements it keeps, together they read every stored element once, and what each holds is
    its rows of the one-rank model, bit for bit."""
    cfg = config(split_policy_dir, "learner.world_size=2", "learner.strategy=fsdp2", "model.dtype=bfloat16")

    async def scenario():
        learner = await started(cfg, worker_cls=CountingReads)
        try:
            return await learner.apply(elements_read), await learner.apply(held)
        finally:
            await learner.shutdown()

    reads, held_by_ranks = asyncio.run(scenario())
    stored = 0
    for file in set(tensor_files(split_policy_dir).values()):
        with safe_open(file, framework="pt") as f:
            stored += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert sum(reads) == stored
    for n, (pieces, _) in zip(reads, held_by_ranks, strict=True):
        assert n == sum(p.numel() for p in pieces.values()) and n < 0.6 * stored
        assert all(p.dtype == torch.bfloat16 for p in pieces.values())
    one_rank = load_policy(ModelConfig(path=str(split_policy_dir), dtype="bfloat16"))[0]
    assert_rank_holds_its_slices(held_by_ranks, one_rank, sharded=True)


def test_a_tensor_stored_under_another_name_is_named(policy_dir, tmp_path):
    path = tmp_path / "renamed"
    shutil.copytree(policy_dir, path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.scale"] = tensors.pop("model.norm.weight")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WholeLoadNeeded, match=r"1 of the model's tensors are not in .* \(first: model\.norm\.weight\)"):
        build_skeleton(ModelConfig(path=str(path)))
    (path / "model.safetensors").unlink()
    with pytest.raises(WholeLoadNeeded, match="holds no model.safetensors"):
        build_skeleton(ModelConfig(path=str(path)))


def test_buffers_are_computed_as_from_pretrained_computes_them_or_named(policy_dir, monkeypatch):
    model, _ = build_skeleton(ModelConfig(path=str(policy_dir)))
    model.to_empty(device="cpu")
    monkeypatch.setattr(model, "_init_weights", lambda module: None)  # a model that computes none
    with pytest.raises(WholeLoadNeeded, match="buffer 'inv_freq' of Qwen2RotaryEmbedding is not computed"):
        compute_buffers(model)
    monkeypatch.undo()
    compute_buffers(model)
    expected = dict(load_policy(ModelConfig(path=str(policy_dir)))[0].named_buffers())
    assert set(dict(model.named_buffers())) == set(expected)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, expected[name]), name


def test_a_run_that_keeps_a_full_copy_or_cannot_read_slices_loads_whole_and_says_why(policy_dir, tmp_path, caplog):
    """No process group is needed: both decisions come before any sharding."""
    sharding = Sharding("fsdp2", 0, 2, torch.device("cpu"))
    no_safetensors = tmp_path / "bin"
    shutil.copytree(policy_dir, no_safetensors)
    torch.save(load_file(no_safetensors / "model.safetensors"), no_safetensors / "pytorch_model.bin")
    (no_safetensors / "model.safetensors").unlink()
    for path, override, why in [(policy_dir, "algorithm.kl_coef=0.1", "algorithm.kl_coef > 0 keeps a full frozen"),
                                (no_safetensors, "algorithm.kl_coef=0", "holds no model.safetensors")]:
        worker = LearnerWorker(config(path, "learner.world_size=2", override), world_size=2)
        with caplog.at_level(logging.WARNING, logger="asyncrl.runtime.learner_worker"):
            model, _ = worker._load(sharding)
        assert not hasattr(model.model.embed_tokens.weight, "to_local")  # whole, not sharded
        assert "learner ranks load the whole model before sharding it: " in caplog.text and why in caplog.text
        caplog.clear()

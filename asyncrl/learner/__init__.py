"""The learner: batches of trajectories in, optimizer steps and new weight versions out."""

from asyncrl.learner.batch import TrainBatch, pack_batch
from asyncrl.learner.learner import Learner

__all__ = ["Learner", "TrainBatch", "pack_batch"]

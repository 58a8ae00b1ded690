"""Deprecated path of :mod:`asyncrl.rollout.client` (moved with the rollout side; the retry
example taught ``from asyncrl.client import Message, Response``). Imports it, warning."""

from asyncrl import moved
from asyncrl.rollout import client

moved.alias(__name__, client)

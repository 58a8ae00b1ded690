"""asyncrl: RL post-training of language models, rollout generation and training running
concurrently. Importing the package installs one thing: the finder that keeps moved import
paths importing (``asyncrl/moved.py``, ``MOVED_MODULES``)."""

from asyncrl import moved as _moved

_moved.install()

"""The rollout side: everything that turns a task into trajectories.

``client.py`` (token in, token out; partial-rollout resume), ``journal.py`` (what an
episode under way has generated, for a checkpoint), ``chat_format.py`` (what a chat
template renders), ``eval_scoring.py`` (mean reward and pass@k), ``workflows/`` (an
episode: single-turn, multi-turn, an OpenAI-SDK agent), ``gateway/`` (the
OpenAI-compatible server an agent talks to, recorded token-exact) and ``worker.py`` (a
rollout worker: one engine replica and the episodes, evaluations and weight loads it
runs). Where workers run, and how calls reach them, is ``asyncrl.runtime``'s business.
"""

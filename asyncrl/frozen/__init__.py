"""Frozen models reached by URL (or loaded beside the rollout): the judge that grades a
response, the teacher whose logprobs a student distils, the refine service an agent's tool
calls. One client shape (:class:`FrozenModel`): a concurrency bound, deadlines, retries, a
failure that names the model, and the seconds it cost."""

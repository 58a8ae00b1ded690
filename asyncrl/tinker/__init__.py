"""``asyncrl serve-tinker``: the Tinker API (Thinking Machines' training and sampling service) over
a model asyncrl loads, for Tinker's own SDK unchanged but for its ``base_url`` (docs/tinker.md).

Split by concern: ``wire`` (the SDK's bodies), ``futures`` (what the SDK polls), ``service``
(sessions, training clients, checkpoints, samplers), ``training`` (one LoRA client over the
learner core), ``losses`` (Tinker's losses as asyncrl's), ``sampling`` (samplers on the built-in
engine), ``turns`` (the training thread, its clients in turns), ``server`` (the routes). Imports
the ``tinker`` package (the ``tinker`` extra): only the command and its tests import this package.
"""
